"""`tfdist bench remat`: the probe's and the allocator's activation bytes, the time and the weights, recomputed
against kept, on sequences short enough for a test."""

import pytest

from helpers import measure_in_fresh_process


@pytest.mark.slow
def test_measure_reports_less_kept_the_same_weights_and_the_time_of_both_models():
    result = measure_in_fresh_process("benchmarks.remat", "dict(repeats=1, steps_per_round=2, scale=0.25)")
    figures, variants = result["figures"], result["variants"]
    assert set(variants) == {"transformer_kept", "transformer_remat", "gemma_kept", "gemma_remat"}
    assert variants["transformer_kept"]["recomputed_layers"] == []
    # Every top-level layer with weights of the transformer; Gemma's embedding and decoder blocks.
    assert "block0_attention" in variants["transformer_remat"]["recomputed_layers"]
    assert "decoder_block_0" in variants["gemma_remat"]["recomputed_layers"]
    for name in ("transformer", "gemma"):
        assert figures[f"{name}_kept_share"] < 0.3, figures  # the probe: what the backward pass reads
        assert figures[f"{name}_meets_diff_target"], figures
        assert figures[f"{name}_time_ratio"] > 0
        assert variants[f"{name}_remat"]["peak_bytes"] < variants[f"{name}_kept"]["peak_bytes"], variants
