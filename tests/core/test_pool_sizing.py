"""The KV pool's minimum size counts speculative lookahead slots: every allocation reserves
num_lookahead_tokens slots past a request's tokens, so a pool that holds exactly max_model_len tokens could
never give a full-length request with speculation its last blocks. Such a pool is refused at start-up; the
smallest pool accepted runs a request all the way to max_model_len."""
from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tokenmill.executor.worker import Worker, min_blocks

BLOCK = 16
MAX_LEN = 64
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": False}


class StubRunner:
    def block_bytes(self, dtype: torch.dtype) -> int:
        return 1024


def sized_worker(num_blocks: int, lookahead: int) -> Worker:
    config = EngineConfig(ModelConfig(), CacheConfig(block_size=BLOCK, num_gpu_blocks_override=num_blocks),
                          SchedulerConfig(num_lookahead_tokens=lookahead))
    worker = Worker(config)
    worker.runner, worker.max_model_len = StubRunner(), MAX_LEN
    return worker


def test_min_blocks_counts_the_lookahead():
    assert min_blocks(64, 0, 16) == 4
    assert min_blocks(64, 4, 16) == 5
    assert min_blocks(60, 4, 16) == 4


def test_pool_of_max_model_len_is_refused_with_speculation():
    assert sized_worker(MAX_LEN // BLOCK, 0).determine_num_blocks(torch.float32) == 4  # no drafts: enough
    with pytest.raises(ValueError, match="4 speculative lookahead slots"):
        sized_worker(MAX_LEN // BLOCK, 4).determine_num_blocks(torch.float32)
    assert sized_worker(MAX_LEN // BLOCK + 1, 4).determine_num_blocks(torch.float32) == 5


def test_engine_refuses_a_pool_too_small_for_lookahead(tiny_llama):
    with pytest.raises(ValueError, match="lookahead"):
        LLM(str(tiny_llama), max_model_len=MAX_LEN, block_size=BLOCK, num_gpu_blocks_override=MAX_LEN // BLOCK,
            speculative_config=NGRAM)


def test_smallest_accepted_pool_runs_a_request_to_max_model_len(tiny_llama):
    llm = LLM(str(tiny_llama), max_model_len=MAX_LEN, block_size=BLOCK,
              num_gpu_blocks_override=min_blocks(MAX_LEN, 4, BLOCK), speculative_config=NGRAM)
    prompt = [5, 6, 7, 8] * 10  # repetitive: the n-gram proposer drafts
    params = SamplingParams(max_tokens=MAX_LEN, temperature=0, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    assert len(prompt) + len(out.token_ids) == MAX_LEN and out.finish_reason == "length"
