"""Token-id prompts in any 1-D integer form (issue 24): numpy int64 values, a numpy array
or a torch tensor give exactly the tokens (and greedy output) of the same ids as a list;
bool, float and 2-D inputs are refused with an error naming ``prompt_token_ids``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from atlas_vlm import LLM, SamplingParams
from atlas_vlm.engine.token_ids import as_token_ids

pytestmark = pytest.mark.text

IDS = [100, 2000, 30000, 151000]


@pytest.fixture(scope="module")
def small(tiny_models):
    return LLM(str(tiny_models["qwen2"][0]), max_model_len=64, num_kvcache_blocks=8, dtype="float32")


@pytest.mark.parametrize("ids", [
    [np.int64(t) for t in IDS],
    tuple(IDS),
    np.array(IDS, dtype=np.int64),
    np.array(IDS, dtype=np.uint32),
    torch.tensor(IDS),
    torch.tensor(IDS, dtype=torch.int32),
], ids=["np.int64-list", "tuple", "ndarray-int64", "ndarray-uint32", "tensor-int64", "tensor-int32"])
def test_any_1d_integer_sequence_is_the_same_prompt(small, ids):
    assert as_token_ids(ids, 151936) == IDS and all(type(t) is int for t in as_token_ids(ids, 151936))
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ref = small.generate(IDS, greedy, use_tqdm=False)[0]
    for prompt in (ids, {"prompt_token_ids": ids}):
        outs = small.generate(prompt, greedy, use_tqdm=False)
        assert len(outs) == 1  # one prompt, not one prompt per id
        assert outs[0].prompt_token_ids == IDS and outs[0].token_ids == ref.token_ids


def test_a_list_of_arrays_is_a_batch(small):
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    outs = small.generate([np.array(IDS), torch.tensor(IDS[:2])], greedy, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [IDS, IDS[:2]]
    assert outs[0].token_ids == small.generate(IDS, greedy, use_tqdm=False)[0].token_ids


@pytest.mark.parametrize(("ids", "words"), [
    (np.array([True, False]), "dtype bool"),
    (torch.tensor([1.0, 2.0]), "dtype torch.float32"),
    (np.array([1.0, 2.0]), "dtype float64"),
    (np.array([[1, 2], [3, 4]]), r"must be 1-D \(one prompt\); got a 2-D numpy array of shape \(2, 2\)"),
    (torch.tensor([[1, 2]]), "got a 2-D tensor of shape"),
    ([1, True], "it holds bool True"),
    ([1, np.bool_(True)], "it holds bool"),
    ([1, 2.5], "it holds float 2.5"),
    ([1, [2, 3]], r"a nested sequence \(2-D input\)"),
    (np.array([], dtype=np.int64), "it is empty"),
    (torch.tensor([5, 151936]), r"ids in \[0, 151936\); it holds 151936"),
])
def test_bad_token_id_inputs_are_refused_by_name(small, ids, words):
    with pytest.raises(ValueError, match="prompt_token_ids") as e:
        small.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1), use_tqdm=False)
    assert e.match(words)
    bm = small.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not small.engine.requests
