"""The platform-ceiling benchmark (`benchmarks.ceiling`) against the real tritonserver: its
models stream exactly what they are asked for, alone and through the ensemble, and each level
counts responses from every client process. Speeds are never asserted."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from benchmarks import ceiling


def test_a_repository_copy_sets_the_stream_instances(tmp_path):
    """`CeilingServer`'s copy: ceiling_stream's config.pbtxt has the one count the shared
    helper rewrites, and every other model is served from the original."""
    from tritonllm.triton_server import repository_with_instances

    repo = repository_with_instances(ceiling.REPOSITORY, ceiling.STREAM_MODEL, 3, tmp_path)
    config = (repo / ceiling.STREAM_MODEL / "config.pbtxt").read_text()
    assert "instance_group [ { count: 3 kind: KIND_CPU } ]" in config
    assert sorted(p.name for p in repo.iterdir()) == sorted(
        p.name for p in ceiling.REPOSITORY.iterdir() if p.name != "__pycache__"
    )
    model = repo / ceiling.STREAM_MODEL / "1" / "model.py"
    assert model.resolve() == ceiling.REPOSITORY / ceiling.STREAM_MODEL / "1" / "model.py"


async def _one_stream(url: str, model: str, inputs: dict) -> list:
    from openai_frontend.triton_client import TritonClient

    client = TritonClient(url, model=model)
    try:
        stream = await client.stream("probe", inputs)
        chunks = []
        while (chunk := await stream.read()) is not None:
            chunks.append(chunk)
        return chunks
    finally:
        await client.close()


def test_ceiling_levels_stream_exact_responses_alone_and_through_the_ensemble(tmp_path):
    from openai_frontend.triton_client import TritonError

    log = tmp_path / "ceiling-server.log"
    # 3 sender threads per instance, as the generator sends from several: each stream stays
    # exact (the clients check every response's count, text and final flag).
    with ceiling.CeilingServer(
        instances=2, client_processes=2, log_path=log, sender_threads=3
    ) as bench:
        url = bench.server.grpc_url
        # One stream read by hand per ensemble: ids counted up, their text written out by the
        # ensemble's last step (ceiling_post, or the stream itself in the fused shape).
        for model in (ceiling.ENSEMBLE_MODEL, ceiling.FUSED_MODEL):
            inputs = {"text_input": "abc", "max_tokens": 5}
            chunks = asyncio.run(_one_stream(url, model, inputs))
            assert [c.num_output_tokens for c in chunks] == [1, 2, 3, 4, 5]
            assert [c.finish_reason for c in chunks] == ["", "", "", "", "length"]
            # the prompt's count in the first and last responses only, as the generator sends
            assert [c.num_input_tokens for c in chunks] == [3, 0, 0, 0, 3]
            want = [str((3 + 7919 * k) % ceiling.VOCAB) for k in range(5)]
            assert [c.text for c in chunks] == want, model
        with pytest.raises(TritonError, match="max_tokens must be >= 1"):
            asyncio.run(
                _one_stream(url, ceiling.STREAM_MODEL, {"input_ids": [1, 2], "max_tokens": 0})
            )
        for mode in ceiling.MODES:
            for c in (1, 3):  # 3 clients over 2 client processes
                level = bench.level(mode, c, tokens=8, seconds=0.5)
                assert level.errors == (), level.errors
                assert level.mode == mode and level.concurrency == c
                assert level.requests >= c and level.responses > 0
                assert level.responses_per_s == level.responses / 0.5
                assert 0 < level.client_max_cores <= level.client_cores
                assert "stub:ceiling_stream" in level.server_cpu
        with pytest.raises(KeyError, match="mode"):
            bench.level("nope", 1, 8, 0.5)
    levels = {"alone": {1: level}, "ensemble": {1: level}, "fused": {1: level}}
    assert ceiling.report(levels).splitlines()[2].startswith("| 1 | ")


def test_the_default_client_processes_grow_with_the_instances():
    parser = argparse.ArgumentParser()
    ceiling.add_arguments(parser)
    assert ceiling.client_processes(parser.parse_args([])) == 4
    assert ceiling.client_processes(parser.parse_args(["--ceiling-instances", "4"])) == 8
    given = ["--ceiling-instances", "4", "--ceiling-client-processes", "3"]
    assert ceiling.client_processes(parser.parse_args(given)) == 3
