"""`tfdist bench network`: the algorithm's bytes, the overlap formula, and a real run checked against the counters."""

import os

import pytest

from helpers import measure_in_fresh_process, run_tfdist, tcp_bytes
from tfdist.bench.network import _figures, algorithm_bytes, markdown_table, overlap

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="namespace hosts need root")


def test_the_algorithms_bytes():
    assert algorithm_bytes("multi_worker", 1000, hosts=2) == {"sent": 1000, "received": 1000}
    assert algorithm_bytes("horovod", 1000, hosts=4) == {"sent": 1500, "received": 1500}  # 2 (N - 1) / N
    assert algorithm_bytes("parameter_server", 1000) == {"sent": 1000, "received": 1000}  # gradients out, weights in
    assert algorithm_bytes("multi_worker_fp16", 1000, hosts=2) == {"sent": 500, "received": 500}
    assert algorithm_bytes("parameter_server_fp16", 1000) == {"sent": 500, "received": 1000}  # weights in float32
    # ZeRO 3: the weights gathered twice and their gradients reduce-scattered, 3 (N - 1) / N.
    assert algorithm_bytes("multi_worker_split3", 1000, hosts=2) == {"sent": 1500, "received": 1500}


def test_a_sparse_gradient_is_all_gathered_or_read_and_sent_as_rows():
    rows_and_indices = (1000, 100)
    # All-reduce kinds: the dense part in the ring, and each host's rows to every other host.
    assert algorithm_bytes("multi_worker", 500, hosts=2, slices=rows_and_indices) == {"sent": 1600, "received": 1600}
    assert algorithm_bytes("horovod", 400, hosts=4, slices=rows_and_indices) == {"sent": 3900, "received": 3900}
    # float16 compression casts the dense part only.
    assert algorithm_bytes("multi_worker_fp16", 500, hosts=2, slices=rows_and_indices)["sent"] == 1350
    # A parameter-server worker reads the weights and the rows, and sends gradients, rows and indices.
    assert algorithm_bytes("parameter_server", 500, slices=rows_and_indices) == {"sent": 1600, "received": 1500}
    # Its float16 gradients: the dense part and the rows halved, the indices as they are.
    assert algorithm_bytes("parameter_server_fp16", 500, slices=rows_and_indices) == {"sent": 850, "received": 1500}


def test_overlap_is_0_for_one_after_the_other_and_1_when_hidden():
    assert overlap(10, 4, 14) == 0
    assert overlap(10, 4, 10) == 1
    assert overlap(10, 4, 12) == pytest.approx(0.5)


def test_settings_measured_together_share_every_round_and_keep_their_own_results(monkeypatch):
    """`tfdist bench plan` takes a probe's cost from the probe's step and adds it to the jobs': run apart,
    minutes of the machine's drift lie between them. Together, each round runs every job of every
    setting once; each setting's result holds only its own jobs' rounds."""
    from tfdist.bench import network

    ran = []

    def fake_job(overrides, launcher, command, read):
        width = next((int(o.split("=")[1]) for o in overrides if o.startswith("model.width=")), 0)
        name = (tuple(command), width, tuple(o for o in overrides if o.startswith("strategy.kind")))

        def one_round():
            ran.append(name)
            # Each setting's steps differ by its model, so a result mixing settings would show it.
            return read({"samples_per_sec": 1000.0, "step_time_ms": 10.0 + width + len(ran) % 2,
                         "trainable_bytes": 4000, "link_bytes_per_step": {"sent": 8000, "received": 8000}})
        return one_round

    monkeypatch.setattr(network, "train_job", fake_job)
    results = network.measure_together({
        "jobs": {"links": ["1gbit", "10gbit"], "kinds": ["horovod"], "variants": False},
        "probe": {"links": ["10gbit"], "kinds": ["horovod", "parameter_server"], "variants": False,
                  "extra": ["model.name=mlp", "model.width=100"]}}, repeats=3)
    jobs = len(ran) // 3
    assert jobs == (1 + 2) + (1 + 2)  # each setting's one-process step and its launches
    assert all(set(ran[:jobs]) == set(ran[r * jobs:(r + 1) * jobs]) for r in (1, 2))  # each round runs them all
    assert list(results["jobs"]["table"]) == ["horovod"] and [row["link"] for row in results["jobs"]["table"]
                                                               ["horovod"]] == ["1gbit", "10gbit"]
    assert set(results["probe"]["table"]) == {"horovod", "parameter_server"}
    assert all(len(samples) == 3 for result in results.values() for samples in result["samples"].values())
    assert all(10 <= row["step_time_ms"] <= 11 for rows in results["jobs"]["table"].values() for row in rows)
    assert all(110 <= row["step_time_ms"] <= 111 for rows in results["probe"]["table"].values() for row in rows)
    assert results["probe"]["jobs"]["compute_only"].endswith("--set model.width=100 --set strategy.kind=one_device")


def test_the_split_optimizers_figures_compare_it_with_the_same_kind_unsplit():
    def row(link, samples, sent, received):
        return {"link": link, "samples_per_sec": samples, "bytes_vs_algorithm": 1.0,
                "link_bytes_per_step": {"sent": sent, "received": received}}

    def timed(step_ms, *args):
        return {**row(*args), "step_time_ms": step_ms}

    figures = _figures({"horovod": [row("100mbit", 1000, 600, 600), row("1gbit", 5000, 600, 600)],
                        "horovod_split": [timed(80, "100mbit", 800, 606, 612), timed(20, "1gbit", 4500, 600, 600)],
                        "horovod_split3": [timed(120, "100mbit", 500, 900, 900), timed(22, "1gbit", 4000, 900, 900)],
                        "horovod_split3_no_prefetch": [timed(132, "100mbit", 450, 900, 900),
                                                       timed(22, "1gbit", 4000, 900, 900)]})
    assert figures["split_bytes_ratio_horovod"] == pytest.approx(1.02)  # the larger direction, at its worst link
    assert figures["split_speed_ratio_horovod"] == pytest.approx(0.8)  # at the slowest link
    # ZeRO 3's step over stage 2's, link by link.
    assert figures["split3_step_vs_split_horovod@100mbit"] == pytest.approx(1.5)
    assert figures["split3_step_vs_split_horovod@1gbit"] == pytest.approx(1.1)
    assert figures["prefetch_gain_horovod@100mbit"] == pytest.approx(1.1)  # the step without it over with it
    assert figures["prefetch_gain_horovod@1gbit"] == pytest.approx(1.0)
    assert algorithm_bytes("multi_worker_split3_no_prefetch", 1000, hosts=2)["sent"] == 1500


@needs_root
@pytest.mark.xdist_group("namespace_hosts")  # with tests/launch/test_hosts.py, which checks that no host is left
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_run_measures_the_links_bytes_as_the_algorithm_counts_them():
    # The sparse-embedding model: its dense layers all-reduced (float16 too), and its table's rows
    # all-gathered or read and sent; the whole table (12.8 MB) crossing would be 100 x the count.
    result = measure_in_fresh_process("tfdist.bench.network", "dict(model='sparse_embedding', links=['1gbit'], "
                                      "kinds=['multi_worker', 'parameter_server'], repeats=1, steps=40)")  # 30 measured
    assert set(result["table"]) == {"multi_worker", "multi_worker_fp16", "multi_worker_packed", "parameter_server",
                                    "parameter_server_fp16"}
    rows, indices = result["sparse_gradient_bytes"]["rows"], result["sparse_gradient_bytes"]["indices"]
    assert result["table_bytes"] > 100 * (result["gradient_bytes"] + rows + indices)
    for kind, (row,) in result["table"].items():
        assert row["link"] == "1gbit" and row["samples_per_sec"] > 0 and row["compute_ms"] > 0
        measured = row["link_bytes_per_step"]
        assert row["algorithm_bytes"] == algorithm_bytes(kind, result["gradient_bytes"], slices=(rows, indices))
        # From the host link's counters: at least the algorithm's bytes, and nothing sent twice or dense.
        for direction in ("sent", "received"):
            expected = row["algorithm_bytes"][direction]
            assert measured[direction] >= expected, (kind, direction, measured)
            resent = row["tcp_retransmits_per_step"] * 1514 if direction == "sent" else 0.0  # TCP's, not the job's
            if kind.endswith("_fp16"):
                # Half the payload carries the float32 job's fixed bytes a step (headers, acknowledgements:
                # about 6 KB for a parameter-server worker), and nothing more.
                (full,) = result["table"][kind.removesuffix("_fp16")]
                fixed = full["link_bytes_per_step"][direction] - full["algorithm_bytes"][direction]
                assert measured[direction] - expected <= fixed + 0.1 * expected + resent, (kind, direction, row)
            else:
                other = row["algorithm_bytes"]["received" if direction == "sent" else "sent"]
                assert measured[direction] <= tcp_bytes(expected, other) + resent, (kind, direction, row)
        assert row["comm_ms"] == pytest.approx(1000 * max(measured.values()) * 8 / 1e9)
    assert result["figures"]["bytes_within_tolerance"] == all(
        result["figures"][f"bytes_vs_algorithm_{kind}"] <= 1.1 for kind in result["table"])
    assert result["figures"]["overlap_multi_worker_link"] == "1gbit"
    assert "overlap_parameter_server" not in result["figures"]
    assert result["figures"]["compression_gain_multi_worker"] == pytest.approx(
        result["table"]["multi_worker_fp16"][0]["samples_per_sec"] / result["table"]["multi_worker"][0]["samples_per_sec"])
    assert "--hosts 2 --link 1gbit" in result["jobs"]["multi_worker@1gbit"]
    assert result["figures"]["compression_gain_parameter_server"] > 0
    assert "strategy.bytes_per_pack=65536" in result["jobs"]["multi_worker_packed@1gbit"]
    assert result["figures"]["overlap_multi_worker_packed_link"] == "1gbit"
    assert markdown_table(result).count("\n") == 6


@pytest.mark.parametrize("flags,message", [
    (["--kinds", "ring"], "`kinds` must be among multi_worker, horovod, parameter_server"),
    (["--links", "fast"], "`--link` must be a rate in tc's notation"),
    (["--set", "train.epochs=1"], "`config` is not used by the network benchmark"),
])
def test_bad_options_are_one_line(flags, message):
    proc = run_tfdist("bench", "network", *flags)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], lines


def test_its_options_are_refused_by_other_benchmarks():
    proc = run_tfdist("bench", "overhead", "--links", "1gbit")
    assert proc.returncode == 2 and "`links` only applies to `bench network` or `bench plan`." in proc.stderr
