"""GPipe and 1F1B task orders, stash counts and a deadlock-free global order."""

import pytest

from tfdist.parallel.schedules import global_order, peak_stash, stage_orders


def test_gpipe_runs_all_forwards_then_all_backwards():
    orders = stage_orders("gpipe", 2, 3)
    assert orders[0] == orders[1] == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1), ("B", 2)]


def test_1f1b_warms_up_then_alternates():
    orders = stage_orders("1f1b", 3, 4)
    assert orders[0] == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3)]
    assert orders[2] == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3), ("B", 3)]


@pytest.mark.parametrize("stages,micro", [(2, 1), (2, 8), (4, 2), (4, 16), (3, 3)])
def test_stash_bounds(stages, micro):
    for order in stage_orders("gpipe", stages, micro):
        assert peak_stash(order) == micro
    peaks = [peak_stash(order) for order in stage_orders("1f1b", stages, micro)]
    assert peaks == [min(stages - k, micro) for k in range(stages)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,micro", [(1, 1), (2, 8), (4, 3), (3, 7)])
def test_global_order_respects_every_dependency(schedule, stages, micro):
    orders = stage_orders(schedule, stages, micro)
    sequence = global_order(orders)
    assert len(sequence) == 2 * stages * micro
    position = {item: i for i, item in enumerate(sequence)}
    for k in range(stages):
        assert [task for stage, task in sequence if stage == k] == orders[k]
        for m in range(micro):
            assert position[(k, ("F", m))] < position[(k, ("B", m))]
            if k:
                assert position[(k - 1, ("F", m))] < position[(k, ("F", m))]
                assert position[(k, ("B", m))] < position[(k - 1, ("B", m))]


def test_a_deadlocking_order_is_refused():
    with pytest.raises(ValueError, match="deadlocks"):
        global_order([[("B", 0), ("F", 0)], [("F", 0), ("B", 0)]])


@pytest.mark.parametrize(
    "args,match",
    [(("zigzag", 2, 2), "must be one of gpipe, 1f1b"), (("1f1b", 0, 2), "must be whole numbers >= 1"),
     (("1f1b", ["/cpu:0", "/cpu:1"], 2), "a pipeline's devices are its `devices=`")],
)
def test_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        stage_orders(*args)
