"""The wire protocol: every inbox decodes what its peers send, and refuses what they don't."""

from __future__ import annotations

import msgspec
import pytest

from actorserve.messages.blocks import AllocateStep, BlockNeed
from actorserve.messages.client import ClientToEngine, GenerateRequest
from actorserve.messages.codec import (
    BlockManagerInbox,
    DecodeError,
    Decoder,
    SchedulerInbox,
    WorkerStepsInbox,
    encode,
    peek_request_id,
)
from actorserve.messages.common import SamplingParams
from actorserve.messages.step import NewRequest, RunningUpdate, StepPlan


def test_a_step_plan_round_trips_through_the_worker_forward_threads_decoder():
    plan = StepPlan(
        0,
        7,
        ["gone"],
        [RunningUpdate("a", [3], 1)],
        [NewRequest("b", [1, 2, 3], 3, [4], 3, SamplingParams(temperature=0.0))],
    )
    assert Decoder(WorkerStepsInbox).decode(encode(plan)) == plan


def test_an_inbox_refuses_a_message_meant_for_another_actor():
    with pytest.raises(DecodeError):
        Decoder(SchedulerInbox).decode(
            encode(AllocateStep(0, 1, [BlockNeed("a", 0, 3, True, [1, 2, 3])], 64))
        )
    assert isinstance(
        Decoder(BlockManagerInbox).decode(encode(AllocateStep(0, 1, [], 64))), AllocateStep
    )


def test_client_messages_name_the_bad_field():
    decoder = Decoder(ClientToEngine)
    bad = msgspec.msgpack.encode(
        {"type": "GenerateRequest", "request_id": "r", "params": {"top_p": "high"}}
    )
    with pytest.raises(DecodeError, match=r"\$\.params\.top_p"):
        decoder.decode(bad)
    unknown_kind = msgspec.msgpack.encode(
        {"type": "GenerateRequest", "request_id": "r", "params": {"output_kind": "batch"}}
    )
    with pytest.raises(
        DecodeError, match=r"Invalid enum value 'batch' - at `\$\.params\.output_kind`"
    ):
        decoder.decode(unknown_kind)
    assert peek_request_id(bad) == "r"
    assert peek_request_id(b"\xc1") is None


@pytest.mark.parametrize(
    "params, field",
    [
        (SamplingParams(max_tokens=0), "max_tokens"),
        (SamplingParams(temperature=-1), "temperature"),
        (SamplingParams(top_p=0), "top_p"),
        (SamplingParams(top_k=-2), "top_k"),
        (SamplingParams(min_p=2), "min_p"),
        (SamplingParams(n=0), "n"),
        (SamplingParams(presence_penalty=2.5), "presence_penalty"),
        (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
        (SamplingParams(logit_bias={10**9: 1.0}), "logit_bias"),
        (SamplingParams(logit_bias={1: 101.0}), "logit_bias"),
        (SamplingParams(logprobs=21), "logprobs"),
        (SamplingParams(prompt_logprobs=-1), "prompt_logprobs"),
        (SamplingParams(min_tokens=9, max_tokens=3), "min_tokens"),
        (SamplingParams(stop_token_ids=[10**9]), "stop_token_ids"),
    ],
)
def test_sampling_params_validation_names_field_and_limit(params, field):
    message = params.validate(vocab_size=1000)
    assert message is not None and message.startswith(field)


def test_default_generate_request_is_small_on_the_wire():
    assert len(encode(GenerateRequest("r", "hi"))) < 60
    assert SamplingParams().validate(vocab_size=10) is None
