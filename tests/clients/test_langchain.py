"""LangChain's ChatOpenAI against the server: invoke and stream give the openai SDK's greedy
answer; bind_tools under a forced tool_choice gives calls whose arguments fit the tool's schema;
with_structured_output (json_schema and function_calling) gives a valid instance. The model is
random: the server's constrained decoding is what makes its tool calls and JSON well formed."""

from __future__ import annotations

from typing import Literal

import jsonschema
import pytest
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

MESSAGES = [("system", "You are terse."), ("user", "Name a colour.")]


class GetWeather(BaseModel):
    """The weather in a city."""

    city: Literal["Paris", "Oslo", "Lima"]
    days: int = Field(ge=1, le=7)


class Convert(BaseModel):
    """Converts an amount between currencies."""

    amount: int = Field(ge=0, le=999)
    currency: Literal["EUR", "USD"]


class Colour(BaseModel):
    name: str = Field(pattern="^[a-z]{3,8}$")
    hex: str = Field(pattern="^#[0-9a-f]{6}$")
    warm: bool


@pytest.fixture(scope="module")
def llm(served):
    # No token cap: a tool call or an object must be whole (the server's grammar ends it).
    return ChatOpenAI(model=served.model, base_url=served.base_url, api_key="x", temperature=0,
                      max_retries=0)  # fmt: skip


def _reference_text(served) -> str:
    messages = [{"role": role, "content": text} for role, text in MESSAGES]
    out = served.client.chat.completions.create(
        model=served.model, messages=messages, temperature=0, max_completion_tokens=24
    )
    return out.choices[0].message.content


def test_invoke_and_stream_give_the_openai_sdks_answer(served):
    llm = ChatOpenAI(model=served.model, base_url=served.base_url, api_key="x", temperature=0,
                     max_tokens=24, max_retries=0)  # fmt: skip
    expected = _reference_text(served)
    assert expected  # a random model still says something in 24 tokens
    answer = llm.invoke([SystemMessage(MESSAGES[0][1]), HumanMessage(MESSAGES[1][1])])
    assert answer.content == expected
    assert answer.response_metadata["finish_reason"] in ("length", "stop")
    chunks = list(llm.stream(MESSAGES))
    assert len(chunks) > 1  # streamed token by token, not one final message
    assert "".join(chunk.content for chunk in chunks) == expected


# strict=True, as OpenAI recommends, adds additionalProperties: false; without it the schema lets
# the model add properties of its own, and a random model never stops inventing one.
@pytest.mark.parametrize("tool_choice", ["GetWeather", "any"])
def test_bind_tools_returns_calls_that_fit_the_schema(llm, tool_choice):
    # "any" is LangChain's name for OpenAI's "required": some tool, the model picks which.
    schemas = {
        t.__name__: convert_to_openai_tool(t, strict=True)["function"]
        for t in (GetWeather, Convert)
    }
    bound = llm.bind_tools(
        [GetWeather, Convert], tool_choice=tool_choice, strict=True, parallel_tool_calls=False
    )
    answer = bound.invoke("What is the weather in Paris this week?")
    assert len(answer.tool_calls) == 1 and not answer.invalid_tool_calls
    (call,) = answer.tool_calls
    assert call["name"] in schemas and call["id"].startswith("call_")
    if tool_choice != "any":
        assert call["name"] == tool_choice
    jsonschema.validate(call["args"], schemas[call["name"]]["parameters"])
    assert answer.response_metadata["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output_gives_a_valid_instance(llm, method):
    structured = llm.with_structured_output(Colour, method=method, strict=True, include_raw=True)
    result = structured.invoke("Describe a colour.")
    assert result["parsing_error"] is None
    assert isinstance(result["parsed"], Colour)
    raw = result["raw"]
    if method == "function_calling":
        assert [call["name"] for call in raw.tool_calls] == ["Colour"]
    else:
        assert Colour.model_validate_json(raw.content) == result["parsed"]
