"""Conversations: a follow-up question names the images of an earlier one by ``conversation_id`` instead of
sending them again. Only keys and token counts are kept (the tokens are in the feature store, their KV in the
engine's prefix cache), in this process's memory, bounded in count and age, per tenant.

Each conversation leases its images' tokens in the feature store (mmrag/core/keys.py KeyLease) while it lives: a
document deleted meanwhile, or ``mmrag store gc``, keeps them, even when they are also an indexed page's pixels.
The lease lasts as long as the conversation (``ttl_s``), is renewed at each use and released when the
conversation expires or is evicted; one forgotten by a killed process lapses by itself ``ttl_s`` after its last
use. Tokens that did go (a lapsed lease, then a gc) answer :class:`ImagesExpiredError`: send the images again.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from mmrag.core.keys import ImageKey, KeyLease, NoLease
from mmrag.core.settings import DEFAULT_TENANT

SEND_AGAIN_FIX = ("send the images again in `images` (with or without that conversation_id): they are encoded "
                  "once more and the conversation goes on")


@dataclass(slots=True, frozen=True)
class QuestionImage:
    """An image a question brought: the key its tokens are stored under, and how many tokens it takes."""

    key: ImageKey
    tokens: int


class UnknownConversationError(LookupError):
    """A conversation id this process does not hold (never started here, expired, evicted, or the server
    restarted); the message says to send the images again."""


class ImagesExpiredError(LookupError):
    """A conversation whose images' tokens are no longer stored (its lease lapsed and a deletion or a gc removed
    them): it is forgotten, and the message says to send the images again."""


@dataclass(slots=True)
class _Conversation:
    used: float  # the clock's time of its last use
    images: tuple[QuestionImage, ...]
    lease: KeyLease

    @property
    def keys(self) -> set[ImageKey]:
        return {i.key for i in self.images}


class Conversations:
    """At most ``per_tenant`` conversations of each tenant and ``max_entries`` in all, each forgotten ``ttl_s``
    after it was last used. A tenant over its bound loses its own least recently used one; over the total, the
    tenant holding the most does: a tenant that starts more and more conversations pushes out only its own (or
    those of a tenant holding even more).

    Used from the event loop only, so the table needs no lock; lease I/O (disk or Redis) runs in a worker thread."""

    def __init__(self, *, max_entries: int, per_tenant: int, ttl_s: float,
                 lease: Callable[[], KeyLease] = NoLease, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries = max_entries
        self.per_tenant = per_tenant
        self.ttl_s = ttl_s
        self._lease = lease  # a new lease per conversation, lasting ttl_s from each take
        self._clock = clock
        self._tenants: dict[str, OrderedDict[str, _Conversation]] = {}  # least recently used first
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def held_by(self, tenant: str) -> int:
        return len(self._tenants.get(tenant, ()))

    def for_tenant(self, tenant: str) -> TenantConversations:
        return TenantConversations(self, tenant)

    async def remember(self, images: Sequence[QuestionImage], conversation_id: str | None = None, *,
                       tenant: str = DEFAULT_TENANT) -> str:
        """Keep ``images`` under ``conversation_id`` (a new id when None), replacing what it held, and lease
        them; the id. Ids are the tenant's own: another tenant's same id names another conversation. The caller
        holds the images' tokens (its answer's lease), so none can go before this lease is taken."""
        conversation_id = conversation_id or secrets.token_urlsafe(16)
        images = tuple(images)
        held = self._tenants.get(tenant, {}).get(conversation_id)
        same = held is not None and held.keys == {i.key for i in images}
        lease = held.lease if same else self._lease()
        await asyncio.to_thread(lease.take, {i.key for i in images})
        if same and self._tenants.get(tenant, {}).get(conversation_id) is not held:
            lease = self._lease()  # evicted meanwhile: its lease may have ended after that renewal
            await asyncio.to_thread(lease.take, {i.key for i in images})
        ended = self._expire()
        replaced = self._put(tenant, conversation_id, _Conversation(self._clock(), images, lease))
        if replaced is not None and replaced.lease is not lease:
            ended.append(replaced.lease)
        await _end(ended + self._evict(tenant))
        return conversation_id

    async def recall(self, conversation_id: str, *, tenant: str = DEFAULT_TENANT) -> tuple[QuestionImage, ...]:
        """The conversation's images, their lease renewed; using them keeps it alive for another ``ttl_s``."""
        await _end(self._expire())
        entry = self._tenants.get(tenant, {}).get(conversation_id)
        if entry is None:
            raise UnknownConversationError(
                f"conversation {conversation_id!r} is unknown or expired (conversations are kept {self.ttl_s:g} s "
                f"after their last question, at most {self.per_tenant} per tenant and {self.max_entries} in all, "
                "and not across restarts): send the images again, with or without that conversation_id")
        gone = await asyncio.to_thread(entry.lease.take, entry.keys)
        if gone:
            self._forget(tenant, conversation_id, entry)
            await _end([entry.lease])
            raise ImagesExpiredError(
                f"the image tokens of conversation {conversation_id!r} are no longer stored ({len(gone)} of "
                f"{len(entry.images)} images: their lease lapsed and a deletion or `mmrag store gc` removed them); "
                "the conversation is forgotten: send the images again, with or without that conversation_id")
        if self._tenants.get(tenant, {}).get(conversation_id) is entry:
            entry.used = self._clock()
            self._tenants[tenant].move_to_end(conversation_id)
        else:  # evicted meanwhile, its lease ended before this renewal: end it again (the answer holds its own)
            await _end([entry.lease])
        return entry.images

    def _put(self, tenant: str, conversation_id: str, entry: _Conversation) -> _Conversation | None:
        table = self._tenants.setdefault(tenant, OrderedDict())
        replaced = table.pop(conversation_id, None)
        table[conversation_id] = entry
        self._count += replaced is None
        return replaced

    def _forget(self, tenant: str, conversation_id: str, entry: _Conversation) -> None:
        table = self._tenants.get(tenant, {})
        if table.get(conversation_id) is entry:
            del table[conversation_id]
            self._count -= 1
            if not table:
                del self._tenants[tenant]

    def _pop_oldest(self, tenant: str) -> KeyLease:
        table = self._tenants[tenant]
        _, entry = table.popitem(last=False)
        self._count -= 1
        if not table:
            del self._tenants[tenant]
        return entry.lease

    def _evict(self, tenant: str) -> list[KeyLease]:
        """The leases of the conversations evicted: ``tenant``'s least recently used over its bound, then, over
        the total, the least recently used of whichever tenant holds the most (the longest idle on a tie)."""
        ended = []
        while self.held_by(tenant) > self.per_tenant:
            ended.append(self._pop_oldest(tenant))
        while self._count > self.max_entries:
            most = max(self._tenants, key=lambda t: (len(self._tenants[t]),
                                                     -next(iter(self._tenants[t].values())).used))
            ended.append(self._pop_oldest(most))
        return ended

    def _expire(self) -> list[KeyLease]:
        """The leases of the conversations expired (oldest use first: each tenant's stop at its first alive)."""
        deadline, ended = self._clock() - self.ttl_s, []
        for tenant in list(self._tenants):
            table = self._tenants[tenant]
            while tenant in self._tenants and next(iter(table.values())).used <= deadline:
                ended.append(self._pop_oldest(tenant))
        return ended


async def _end(leases: Iterable[KeyLease]) -> None:
    leases = list(leases)
    if leases:
        await asyncio.to_thread(lambda: [lease.end() for lease in leases])


@dataclass(slots=True, frozen=True)
class TenantConversations:
    """One tenant's conversations: a conversation id another tenant made is unknown here."""

    conversations: Conversations
    tenant: str

    async def remember(self, images: Sequence[QuestionImage], conversation_id: str | None = None) -> str:
        return await self.conversations.remember(images, conversation_id, tenant=self.tenant)

    async def recall(self, conversation_id: str) -> tuple[QuestionImage, ...]:
        return await self.conversations.recall(conversation_id, tenant=self.tenant)
