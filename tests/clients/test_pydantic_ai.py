"""Pydantic AI's agent on the server's chat endpoint: an output_type model comes back as a valid
instance, through its default tool output (a forced "final_result" tool call) and through native
output (response_format json_schema). The model is random: the server's constrained decoding is
what makes the answer parse."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, Field
from pydantic_ai import Agent, NativeOutput, ToolOutput
from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider


class Colour(BaseModel):
    name: str = Field(pattern="^[a-z]{3,8}$")
    hex: str = Field(pattern="^#[0-9a-f]{6}$")
    warm: bool


@pytest.fixture(scope="module")
def model(served):
    provider = OpenAIProvider(base_url=served.base_url, api_key="x")
    return OpenAIChatModel(served.model, provider=provider)


@pytest.mark.parametrize("output", ["tool", "native"])
def test_agent_output_type_is_a_valid_instance(model, output):
    output_type = ToolOutput(Colour) if output == "tool" else NativeOutput(Colour)
    agent = Agent(model, output_type=output_type, model_settings={"temperature": 0})
    result = agent.run_sync("Describe a colour.")
    assert isinstance(result.output, Colour)
    (response,) = [m for m in result.all_messages() if isinstance(m, ModelResponse)]
    (part,) = response.parts  # one answer, accepted on the first try (no retry round)
    if output == "tool":
        assert isinstance(part, ToolCallPart) and response.finish_reason == "tool_call"
        assert Colour.model_validate(part.args_as_dict()) == result.output
    else:
        assert isinstance(part, TextPart) and response.finish_reason == "stop"
        assert Colour.model_validate_json(part.content) == result.output
    assert result.usage.requests == 1 and result.usage.output_tokens > 0
