"""Cutting Sequential and functional models into stages."""

import keras
import pytest

from tfdist.parallel.partition import balance, split


def _sequential():
    return keras.Sequential(
        [keras.Input((8,))] + [keras.layers.Dense(16, name=f"d{i}") for i in range(4)]
    )


def _branchy():
    """a -> (b1, b2) -> add -> d, plus a skip from `a` to the output head."""
    inp = keras.Input((8,), name="x")
    a = keras.layers.Dense(16, name="a")(inp)
    b1 = keras.layers.Dense(16, name="b1")(a)
    b2 = keras.layers.Dense(16, name="b2")(a)
    c = keras.layers.Add(name="c")([b1, b2])
    d = keras.layers.Dense(16, name="d")(c)
    e = keras.layers.Concatenate(name="e")([d, a])
    out = keras.layers.Dense(3, name="out")(e)
    return keras.Model(inp, out)


def test_balance_minimises_the_costliest_stage():
    assert balance([1, 1, 1, 1], 2) == [2]
    assert balance([5, 1, 1, 1, 1, 1], 2) == [1]
    assert balance([1, 2, 3, 4, 5], 3) == [3, 4]  # (1+2+3), 4, 5


def test_explicit_boundaries_by_name_and_index():
    model = _sequential()
    by_name = split(model, 2, boundaries=["d1"])
    by_index = split(model, 2, boundaries=[1])
    assert [s.layer_names for s in by_name.stages] == [["d0"], ["d1", "d2", "d3"]]
    assert [s.layer_names for s in by_index.stages] == [["d0"], ["d1", "d2", "d3"]]
    assert by_name.basis == "explicit"


def test_balanced_by_params_splits_evenly():
    partition = split(_sequential(), 2, balance_by="params")
    assert [s.layer_names for s in partition.stages] == [["d0", "d1"], ["d2", "d3"]]
    assert partition.basis == "params"
    assert [s.num_params for s in partition.stages] == [144 + 272, 272 + 272]


def test_balanced_by_time_measures_every_stage():
    partition = split(_sequential(), 2)
    assert partition.basis == "time"
    report = partition.report()
    assert all(s["predicted_ms"] > 0 and s["measured_ms"] > 0 for s in report["stages"])
    assert sum(len(s["layers"]) for s in report["stages"]) == 4


def test_predicted_stage_times_count_the_per_call_cost_once_as_a_stage_pays_it(monkeypatch):
    """Each layer is timed as a call of its own, and every call has a fixed cost; the stage pays it once.
    Summing the layers' raw times predicted 263 ms for a MobileNetV2 stage measured at 87. With a clock
    whose calls cost 1 ms plus 0.1 ms per Dense layer, the prediction must equal the measured time."""
    from tfdist.parallel import partition

    def fake_time_ms(fn_model, input_tensors, batch, repeats=3):
        return 1.0 + 0.1 * sum(1 for layer in fn_model.layers if isinstance(layer, keras.layers.Dense))

    monkeypatch.setattr(partition, "_time_ms", fake_time_ms)
    model = keras.Sequential([keras.Input((4,)), *(keras.layers.Dense(4) for _ in range(12))])
    result = split(model, 2, balance_by="time")
    assert result.basis == "time" and [len(s.layer_names) for s in result.stages] == [6, 6]
    for stage in result.stages:
        assert stage.measured_ms == pytest.approx(1.6)
        assert stage.predicted_ms == pytest.approx(stage.measured_ms)


def test_a_balanced_cut_is_replaced_by_the_one_agreed_on():
    # In a multi-process job every process cuts where process 0 did, whatever its own measurements say.
    proposed = []

    def process_0s(starts):
        proposed.append(list(starts))
        return [3]

    partition = split(_sequential(), 2, balance_by="params", agree=process_0s)
    assert proposed == [[2]]
    assert [s.layer_names for s in partition.stages] == [["d0", "d1", "d2"], ["d3"]]


def test_functional_cut_carries_every_crossing_tensor():
    partition = split(_branchy(), 3, boundaries=["b2", "e"])
    first, middle, last = partition.stages
    assert first.layer_names == ["a", "b1"]
    # Both `a` (for b2 and for the skip) and b1's output cross the first cut.
    assert len(first.produces) == 2
    assert {id(t) for t in first.produces} == {id(t) for t in middle.consumes + middle.passes}
    # `a` is read by b2 in the middle stage and also travels on for the skip.
    a = first.produces[0]
    assert any(t is a for t in middle.consumes)
    assert len(middle.passes) == 1 and middle.passes[0] is a
    assert middle.layer_names == ["b2", "c", "d"]
    assert last.layer_names == ["e", "out"]
    assert last.produces == partition.outputs


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_stages=5), "must not exceed the model's 4 layers"),
        (dict(num_stages=2, boundaries=["nope"]), "names a layer the model does not have"),
        (dict(num_stages=3, boundaries=["d2", "d1"]), "execution order"),
        (dict(num_stages=2, boundaries=["d0"]), "execution order and leave no stage empty"),
        (dict(num_stages=2, boundaries=["d1", "d2"]), "must name 1 layer"),
        (dict(num_stages=2, boundaries=[7]), "indices from 1 to 3"),
        (dict(num_stages=2, balance_by="flops"), "must be one of"),
    ],
)
def test_bad_partitions(kwargs, match):
    with pytest.raises(ValueError, match=match):
        split(_sequential(), **kwargs)


def test_a_shared_layer_cannot_straddle_a_cut():
    inp = keras.Input((8,))
    shared = keras.layers.Dense(8, name="shared")
    h = shared(inp)
    h = keras.layers.Dense(8, name="mid")(h)
    out = shared(h)
    model = keras.Model(inp, out)
    with pytest.raises(ValueError, match="layer 'shared' is used in stages 0 and 1"):
        split(model, 2, boundaries=["mid"])


def test_a_subclassed_model_is_refused():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(x)

    model = Net()
    model(keras.ops.zeros((1, 3)))
    with pytest.raises(ValueError, match="subclassed model has no layer graph"):
        split(model, 2)


def test_timing_the_stages_leaves_every_variable_as_it_was():
    """The probe runs layers in training mode on random data; BatchNorm statistics and Dropout seeds must not move."""
    import numpy as np

    model = keras.Sequential([
        keras.Input((6,)), keras.layers.Dense(8), keras.layers.BatchNormalization(),
        keras.layers.Dropout(0.5), keras.layers.Dense(3),
    ])
    before = [v.numpy().copy() for v in model.variables]
    partition = split(model, 2, balance_by="time", micro_batch_size=16)
    assert partition.basis == "time" and all(s.measured_ms for s in partition.stages)
    for v, value in zip(model.variables, before):
        np.testing.assert_array_equal(v.numpy(), value, err_msg=v.path)  # exact: timing must not train
