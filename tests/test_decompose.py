"""Question decomposition: the rules, the model's validated JSON, the fallback, and llama-index interop."""

from __future__ import annotations

import json
import sys

import jsonschema
import pytest
from llama_index.core.base.response.schema import Response
from llama_index.core.llms import MockLLM
from llama_index.core.query_engine import CustomQueryEngine, SubQuestionQueryEngine
from llama_index.core.response_synthesizers import get_response_synthesizer
from llama_index.core.schema import QueryBundle
from llama_index.core.settings import Settings
from llama_index.core.tools import QueryEngineTool, ToolMetadata

from rag.decompose import (
    BadQuestionError,
    Decomposer,
    MMRAGQuestionGenerator,
    ModelDecomposer,
    Rejection,
    RejectedDecomposition,
    RuleDecomposer,
    content_words,
    sub_question_schema,
    validate_sub_questions,
)
from mmrag.core.engine import EngineWrapper
from serving.engine.prompt import SYSTEM_PROMPTS

RULE_CASES = [
    ("What is the retry limit and the timeout of the ingest service?",
     ["What is the retry limit of the ingest service?", "What is the timeout of the ingest service?"]),
    ("What were the revenues of Acme, Globex and Initech?",
     ["What were the revenues of Acme?", "What were the revenues of Globex?", "What were the revenues of Initech?"]),
    ("What is the retry limit? What is the timeout?", ["What is the retry limit?", "What is the timeout?"]),
    ("What is the retry limit; what is the timeout?", ["What is the retry limit?", "What is the timeout?"]),
    ("What does the diagram show?", ["What does the diagram show?"]),
    ("Compare the revenue of Acme and Globex.", ["What is the revenue of Acme?", "What is the revenue of Globex?"]),
    ("Compare Redis with Qdrant", ["What is Redis?", "What is Qdrant?"]),
    ("How does Redis compare to Qdrant in terms of latency?",
     ["What is the latency of Redis?", "What is the latency of Qdrant?"]),
    ("What is the difference in latency between Redis and Qdrant?",
     ["What is the latency of Redis?", "What is the latency of Qdrant?"]),
    ("What was the revenue in Q3 vs Q4?", ["What was the revenue in Q3?", "What was the revenue in Q4?"]),
    ("What is the ingest latency as well as the query latency?",
     ["What is the ingest latency?", "What is the query latency?"]),
    ("Which services are shown and how are they deployed?", ["Which services are shown?", "How are they deployed?"]),
    ("How many pages and figures does the report have?",
     ["How many pages does the report have?", "How many figures does the report have?"]),
    ("What were the revenues of Acme and Globex in 2023?",
     ["What were the revenues of Acme in 2023?", "What were the revenues of Globex in 2023?"]),
    ("What is the revenue of Acme and the cost of Globex?",
     ["What is the revenue of Acme?", "What is the cost of Globex?"]),
    ("For the ingest service, what is the retry limit and the timeout?",
     ["For the ingest service, what is the retry limit?", "For the ingest service, what is the timeout?"]),
    ("What is the retry limit of the ingest service, and also what is the timeout?",
     ["What is the retry limit of the ingest service?", "What is the timeout of the ingest service?"]),
    ("Where and when was the report published?", ["Where was the report published?", "When was the report published?"]),
    ("What is the revenue?  What is the  revenue?", ["What is the revenue?"]),
    ("What is the relationship between ingest and query?", ["What is the relationship between ingest and query?"]),
    ("What is the timeout and why?", ["What is the timeout and why?"]),
    # Five items under max_n=4: asked whole rather than dropping one silently.
    ("What were the revenues of A1, B2, C3, D4 and E5?", ["What were the revenues of A1, B2, C3, D4 and E5?"]),
]


@pytest.mark.parametrize("question, expected", RULE_CASES, ids=[q for q, _ in RULE_CASES])
def test_the_rules_split_compound_questions_into_self_contained_sub_questions(question, expected):
    subs = RuleDecomposer(max_n=4).split(question)
    assert subs == expected
    # What the rules produce would also pass the model's grounding check.
    assert validate_sub_questions(json.dumps({"sub_questions": subs}), question, max_n=4, max_len=200) == subs


def test_the_rules_never_return_more_than_max_n():
    assert RuleDecomposer(max_n=2).split("What were the revenues of Acme, Globex and Initech?") == [
        "What were the revenues of Acme, Globex and Initech?"
    ]


# --- the validator, as a pure function ---------------------------------------------------------------------

QUESTION = "What is the retry limit and the timeout of the ingest service?"


def check(raw: str, *, max_n: int = 4, max_len: int = 200) -> list[str]:
    return validate_sub_questions(raw, QUESTION, max_n=max_n, max_len=max_len)


def test_a_grounded_reply_is_accepted():
    raw = '{"sub_questions": ["What is the retry limit?", "What are the ingest service timeouts?"]}'
    assert check(raw) == ["What is the retry limit?", "What are the ingest service timeouts?"]


@pytest.mark.parametrize(
    "raw, kind, detail",
    [
        ('{"sub_questions": ["What is the retry limit?", "Who won the match?"]}', Rejection.UNGROUNDED,
         "'Who won the match?' shares no content word"),
        ('{"sub_questions": ["What is it?"]}', Rejection.UNGROUNDED, "shares no content word"),
        (json.dumps({"sub_questions": [f"What is retry limit {i}?" for i in range(5)]}), Rejection.COUNT,
         "5 sub-questions, expected 1 to 4"),
        ('{"sub_questions": []}', Rejection.COUNT, "0 sub-questions"),
        ('{"sub_questions": ["What is the timeout?", "what is  the timeout"]}', Rejection.DUPLICATE,
         "appears more than once"),
        ('{"sub_questions": ["What is the timeout?"', Rejection.MALFORMED, "not JSON"),
        ("the retry limit", Rejection.MALFORMED, "not JSON"),
        ('{"questions": ["What is the timeout?"]}', Rejection.SCHEMA, "expected"),
        ('{"sub_questions": ["What is the timeout?"], "note": "x"}', Rejection.SCHEMA, "expected"),
        ('{"sub_questions": ["What is the timeout?"], "together": "yes"}', Rejection.SCHEMA, "true or false"),
        ('{"sub_questions": "What is the timeout?"}', Rejection.SCHEMA, "not a list of strings"),
        ('{"sub_questions": ["   "]}', Rejection.LENGTH, "expected 1 to 200"),
        (json.dumps({"sub_questions": ["What is the timeout " + "x" * 300]}), Rejection.LENGTH, "expected 1 to 200"),
        ('{"sub_questions": ["What is the timeout\x07?"]}', Rejection.CONTROL, "has control characters"),
        ('{"sub_questions": ["Who won\x07?"]}', Rejection.UNGROUNDED, "shares no content word"),
    ],
    ids=["ungrounded", "no-content-words", "too-many", "none", "duplicates", "truncated-json", "prose",
         "wrong-key", "extra-key", "together-not-a-bool", "not-a-list", "blank", "too-long", "raw-control-char",
         "ungrounded-before-control-char"],
)
def test_a_reply_that_fails_a_check_is_rejected_with_the_reason(raw, kind, detail):
    with pytest.raises(RejectedDecomposition) as info:
        check(raw)
    assert info.value.kind is kind
    assert str(info.value).startswith(f"{kind.value}: ") and detail in str(info.value)


@pytest.mark.parametrize("reply, relates", [
    ({"sub_questions": ["What is the revenue of 2023?", "What is the revenue of 2024?"], "together": True}, True),
    ({"sub_questions": ["What is the revenue of 2023?", "What is the revenue of 2024?"], "together": False}, False),
    ({"sub_questions": ["What is the revenue of 2023?", "What is the revenue of 2024?"]}, False),
])
async def test_a_model_decomposer_can_say_its_parts_need_their_pages_together(reply, relates):
    """The model's ``"together"`` flag reaches the decomposition (rag/plans.choose_answer reads it: joint)."""
    from mmrag.core.engine import Completion, Usage

    class Replies:  # the model's reply, as a stand-in for an engine (the schema-guided one is tested above)
        random_weights = False

        async def generate(self, plan, **_):
            return Completion(json.dumps(reply), [], Usage(), "stand-in", "stop")

    question = "What was the revenue of 2023 and the revenue of 2024?"
    decomposition = await Decomposer(Replies()).decompose(question)  # type: ignore[arg-type]
    assert decomposition.source == "model" and len(decomposition.sub_questions) == 2
    assert (decomposition.relates is not None) is relates


async def test_a_decomposer_that_remembers_asks_the_model_once_per_question_within_its_bound():
    from mmrag.core.engine import Completion, Usage

    asked: list[str] = []

    class Replies:
        random_weights = False

        async def generate(self, plan, **_):
            asked.append(plan.text)
            subs = [f"What is the {w} of the service?" for w in plan.text.split()[2:4]]
            return Completion(json.dumps({"sub_questions": subs}), [], Usage(), "stand-in", "stop")

    one, two = "What is timeout and retries of the service?", "What is owner and budget of the service?"
    remembering = Decomposer(Replies(), remember=1)  # type: ignore[arg-type]
    first = await remembering.decompose(one)
    assert await remembering.decompose(one) == first and asked == [one]  # the repeat sent nothing
    await remembering.decompose(two)  # the bound: one question, so the first is forgotten
    await remembering.decompose(one)
    assert asked == [one, two, one]
    forgetful = Decomposer(Replies())  # type: ignore[arg-type]
    await forgetful.decompose(one)
    await forgetful.decompose(one)
    assert asked[3:] == [one, one]


def test_grounding_compares_content_words_with_plurals_stripped():
    assert content_words("What are the Timeouts of the services?") == {"timeout", "service"}
    assert content_words("the latencies of the processes") == content_words("latency process")


# --- bad questions -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "question, message",
    [("", "the question is empty: send a question"), ("  \n ", "the question is empty"),
     ("x" * 10_000, "question too long (10000 chars, limit 2000): shorten it")],
    ids=["empty", "blank", "10k-chars"],
)
async def test_a_bad_question_is_refused_with_what_to_do(question, message):
    with pytest.raises(BadQuestionError) as info:
        await Decomposer(None).decompose(question)
    assert isinstance(info.value, ValueError)
    assert message in str(info.value)


async def test_the_length_limit_is_a_setting():
    with pytest.raises(BadQuestionError, match=r"\(31 chars, limit 30\)"):
        await Decomposer(None, max_question_chars=30).decompose("What is the timeout of service?")


# --- the model, through the real in-process vLLM (tiny random-weight Qwen2-VL) ----------------------------


@pytest.mark.engine
async def test_guided_decoding_makes_the_random_model_reply_schema_valid_json(inprocess_engine):
    # Room for the longest reply the schema allows (a random model writes long strings); the default bound cuts it.
    model = ModelDecomposer(inprocess_engine, max_n=4, max_len=200, max_tokens=4 * (2 * 200 + 8) + 32)
    completion = await model.propose(QUESTION)
    # The random weights chose every token, the grammar the shape. strict=False: xgrammar lets raw control
    # characters into length-bounded strings (see validate_sub_questions); JSON parsers disagree on those.
    reply = json.loads(completion.text, strict=False)
    jsonschema.validate(reply, sub_question_schema(4, 200))
    assert completion.finish_reason == "stop"
    assert completion.usage.image_tokens == 0


@pytest.mark.engine
async def test_the_random_models_ungrounded_reply_falls_back_to_the_rules(inprocess_engine):
    assert inprocess_engine.random_weights
    decomposition = await Decomposer(inprocess_engine).decompose(QUESTION)
    assert decomposition.source == "rules"
    # Its sub-questions share no word with the question, or run past the bound (MMRAG_DECOMPOSE_MAX_TOKENS).
    assert decomposition.rejected_reason.startswith(("ungrounded: sub-question ", "truncated: the reply stopped"))
    assert decomposition.sub_questions == RuleDecomposer().split(QUESTION)


class CountingEngine(EngineWrapper):
    """The session engine, counting the requests it is sent."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.completions = []

    async def generate(self, plan, **kwargs):
        completion = await self.inner.generate(plan, **kwargs)
        self.completions.append(completion)
        return completion


@pytest.mark.engine
async def test_a_question_the_rules_find_single_part_costs_no_model_request(inprocess_engine):
    engine = CountingEngine(inprocess_engine)
    single = await Decomposer(engine).decompose("What does the architecture diagram show?")
    assert (single.sub_questions, single.source, engine.completions) == (["What does the architecture diagram show?"],
                                                                          "rules", [])
    await Decomposer(engine).decompose(QUESTION)  # compound: the model is asked, once
    assert len(engine.completions) == 1 and engine.completions[0].usage.completion_tokens <= 160


@pytest.mark.engine
async def test_the_fixed_length_stand_in_decodes_exactly_its_tokens_then_the_rules_split(inprocess_engine):
    engine = CountingEngine(inprocess_engine)
    decomposition = await Decomposer(engine, fixed_tokens=24).decompose(QUESTION)
    (completion,) = engine.completions
    assert completion.usage.completion_tokens == 24 and completion.finish_reason == "length"
    assert decomposition.source == "rules" and decomposition.rejected_reason.startswith("truncated")
    assert decomposition.sub_questions == RuleDecomposer().split(QUESTION)


def test_the_model_is_asked_greedily_without_images_under_the_sub_question_schema():
    plan = ModelDecomposer(engine=None, max_n=4, max_len=200).plan(QUESTION)  # type: ignore[arg-type]
    assert (plan.images, plan.text, plan.system_prompt_id) == ((), QUESTION, "decompose")
    assert "decompose" in SYSTEM_PROMPTS
    assert plan.sampling.temperature == 0.0 and plan.sampling.max_tokens == 160  # bounded: MMRAG_DECOMPOSE_MAX_TOKENS
    assert json.loads(plan.sampling.json_schema) == {
        "type": "object",
        "properties": {"sub_questions": {
            "type": "array", "items": {"type": "string", "minLength": 3, "maxLength": 200},
            "minItems": 1, "maxItems": 4,
        }, "together": {"type": "boolean"}},  # optional: the parts need their pages seen together
        "required": ["sub_questions"],
        "additionalProperties": False,
    }


# --- llama-index -------------------------------------------------------------------------------------------


class EchoQueryEngine(CustomQueryEngine):
    """Test double for a query engine tool: answers each sub-question with its own text."""

    def custom_query(self, query_str: str) -> str:
        return f"echo: {query_str}"

    async def acustom_query(self, query_str: str) -> str:
        return f"echo: {query_str}"


def echo_tool(name: str) -> QueryEngineTool:
    return QueryEngineTool(EchoQueryEngine(), ToolMetadata(name=name, description=f"pages of {name}"))


def _openai_modules() -> set[str]:
    return {m for m in sys.modules if m.startswith(("llama_index.llms.openai", "llama_index.question_gen.openai"))}


async def test_sub_question_query_engine_runs_on_our_generator_without_openai(inprocess_engine):
    llm_before = Settings._llm
    loaded_before = _openai_modules()  # other tests (the OpenAI-compatible route's) load llama-index's OpenAILike
    decomposer = Decomposer(inprocess_engine)
    engine = SubQuestionQueryEngine(
        question_gen=MMRAGQuestionGenerator(decomposer),
        query_engine_tools=[echo_tool("pages")],
        # llama-index needs an LLM for the synthesizer; MockLLM (llama-index's own) stands in for it here.
        response_synthesizer=get_response_synthesizer(llm=MockLLM(), use_async=True),
        verbose=False,
    )
    response = await engine.aquery(QUESTION)
    assert isinstance(response, Response)
    expected = (await decomposer.decompose(QUESTION)).sub_questions
    answered = [n.node.get_content() for n in response.source_nodes]
    assert answered == [f"Sub question: {q}\nResponse: echo: {q}" for q in expected]
    # llama-index reaches for OpenAI through its default LLM (Settings.llm) and its OpenAI question generator;
    # neither was touched: the query loaded none of their modules. (The `openai` SDK itself is loaded anyway: vLLM
    # imports it.)
    assert Settings._llm is llm_before
    assert _openai_modules() == loaded_before


async def test_each_sub_question_goes_to_every_tool():
    generator = MMRAGQuestionGenerator(Decomposer(None))
    tools = [echo_tool("acme").metadata, echo_tool("globex").metadata]
    subs = await generator.agenerate(tools, QueryBundle("What were the revenues of Acme and Globex?"))
    assert [(s.sub_question, s.tool_name) for s in subs] == [
        ("What were the revenues of Acme?", "acme"), ("What were the revenues of Acme?", "globex"),
        ("What were the revenues of Globex?", "acme"), ("What were the revenues of Globex?", "globex"),
    ]
    with pytest.raises(ValueError, match="at least one query engine tool"):
        await generator.agenerate([], QueryBundle("What is the timeout?"))


def test_generate_runs_the_async_path_where_no_loop_is_running():
    subs = MMRAGQuestionGenerator(Decomposer(None)).generate([echo_tool("pages").metadata], QueryBundle(QUESTION))
    assert [s.sub_question for s in subs] == RuleDecomposer().split(QUESTION)


async def test_generate_inside_a_running_loop_says_to_use_aquery():
    with pytest.raises(RuntimeError, match=r"aquery"):
        MMRAGQuestionGenerator(Decomposer(None)).generate([echo_tool("pages").metadata], QueryBundle(QUESTION))


def test_the_generator_has_no_prompts_to_update():
    generator = MMRAGQuestionGenerator(Decomposer(None))
    assert generator.get_prompts() == {}
    with pytest.raises(ValueError, match="SYSTEM_PROMPTS"):
        generator.update_prompts({"decompose": "anything"})
