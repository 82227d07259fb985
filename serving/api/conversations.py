"""Conversations: a follow-up question names the images of an earlier one by ``conversation_id`` instead of
sending them again. Only keys and token counts are kept (the tokens are in the feature store, their KV in the
engine's prefix cache), in this process's memory, bounded in count and age."""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from core.keys import ImageKey
from core.settings import DEFAULT_TENANT


@dataclass(slots=True, frozen=True)
class QuestionImage:
    """An image a question brought: the key its tokens are stored under, and how many tokens it takes."""

    key: ImageKey
    tokens: int


class UnknownConversationError(LookupError):
    """A conversation id this process does not hold (never started here, expired, evicted, or the server
    restarted); the message says to send the images again."""


class Conversations:
    """At most ``max_entries`` conversations, each forgotten ``ttl_s`` after it was last used; when full, the
    least recently used goes first. Used from the event loop only, so it needs no lock."""

    def __init__(self, *, max_entries: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[tuple[str, str], tuple[float, tuple[QuestionImage, ...]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def for_tenant(self, tenant: str) -> TenantConversations:
        return TenantConversations(self, tenant)

    def remember(self, images: Sequence[QuestionImage], conversation_id: str | None = None, *,
                 tenant: str = DEFAULT_TENANT) -> str:
        """Keep ``images`` under ``conversation_id`` (a new id when None), replacing what it held; the id.
        Ids are the tenant's own: another tenant's same id names another conversation."""
        conversation_id = conversation_id or secrets.token_urlsafe(16)
        self._expire()
        entry = (tenant, conversation_id)
        self._entries[entry] = (self._clock(), tuple(images))
        self._entries.move_to_end(entry)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return conversation_id

    def recall(self, conversation_id: str, *, tenant: str = DEFAULT_TENANT) -> tuple[QuestionImage, ...]:
        """The conversation's images; using them keeps it alive for another ``ttl_s``."""
        self._expire()
        if (tenant, conversation_id) not in self._entries:
            raise UnknownConversationError(
                f"conversation {conversation_id!r} is unknown or expired (conversations are kept "
                f"{self.ttl_s:g} s after their last question, at most {self.max_entries} at once, and not across "
                "restarts): send the images again, with or without that conversation_id"
            )
        _, images = self._entries[(tenant, conversation_id)]
        self.remember(images, conversation_id, tenant=tenant)
        return images

    def _expire(self) -> None:
        # Oldest use first: stop at the first entry still alive.
        deadline = self._clock() - self.ttl_s
        while self._entries and next(iter(self._entries.values()))[0] <= deadline:
            self._entries.popitem(last=False)


@dataclass(slots=True, frozen=True)
class TenantConversations:
    """One tenant's conversations: a conversation id another tenant made is unknown here."""

    conversations: Conversations
    tenant: str

    def remember(self, images: Sequence[QuestionImage], conversation_id: str | None = None) -> str:
        return self.conversations.remember(images, conversation_id, tenant=self.tenant)

    def recall(self, conversation_id: str) -> tuple[QuestionImage, ...]:
        return self.conversations.recall(conversation_id, tenant=self.tenant)
