"""The user's own data and models from config: npz, TFRecords, image folders, functions, files.

Every test writes its own small files (the digits) into a temporary
directory; nothing is downloaded.
"""

import os
import pickle
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdist import _compat, training
from tfdist.config import load_config
from tfdist.config.validation import check_job
from tfdist.data import load_source
from tfdist.data.sources import shard
from tfdist.errors import ConfigError

from sample_files import FEATURES, digits as _digits, write_image_folder as _write_image_folder
from sample_files import write_tfrecords as _write_tfrecords


def _config(*overrides):
    return load_config(None, ["strategy.kind=one_device", "train.verbose=0", "train.epochs=6",
                              "model.width=16", *overrides])


def _trained(config):
    result = training.run(config, out=open(os.devnull, "w"))
    return result


def test_npz_arrays_train_with_and_without_a_validation_pair(tmp_path):
    x, y = _digits()
    np.savez(tmp_path / "digits.npz", x=x, y=y)
    np.savez(tmp_path / "pair.npz", x=x[:1400], y=y[:1400], x_val=x[1400:], y_val=y[1400:])
    held_out = load_source(_config(f"data.dataset=npz:{tmp_path / 'digits.npz'}").data, seed=0)
    assert held_out.num_classes == 10 and held_out.train.count == len(x) - round(0.2 * len(x))
    result = _trained(_config(f"data.dataset=npz:{tmp_path / 'pair.npz'}"))
    assert result["steps_per_epoch"] == 1400 // 64
    assert result["final"]["val_accuracy"] > 0.85


def test_tfrecord_shards_hold_out_a_stable_share_and_train(tmp_path):
    x, y = _digits()
    pattern = _write_tfrecords(tmp_path / "records", 3, x, y)
    config = _config(f"data.dataset=tfrecord:{pattern}", f"data.features={FEATURES}")
    source = load_source(config.data, seed=0)
    validation = [(b[0].numpy().tobytes(), int(b[1])) for b in source.validation.dataset]
    train = [(b[0].numpy().tobytes(), int(b[1])) for b in source.train.dataset]
    assert len(train) + len(validation) == len(x) and not set(train) & set(validation)
    assert source.train.count == len(train) and 0.15 < len(validation) / len(x) < 0.25
    assert source.input_shape == (8, 8, 1) and source.train.files == 3
    result = _trained(config)
    assert result["final"]["val_accuracy"] > 0.85
    assert result["input_sharding"] == "none"


def test_an_image_folder_trains_with_its_classes_from_the_folder_names(tmp_path):
    x, y = _digits()
    directory = _write_image_folder(tmp_path / "images", x, y)
    config = _config(f"data.dataset=images:{directory}", "data.image_size=8")
    source = load_source(config.data, seed=0)
    assert source.num_classes == 3 and source.input_shape == (8, 8, 1)
    images, labels = next(iter(source.train.dataset.batch(500)))
    assert float(tf.reduce_max(images)) <= 1.0 and set(labels.numpy()) == {0, 1, 2}
    assert source.train.count + sum(1 for _ in source.validation.dataset) == 180
    result = _trained(config)
    assert result["final"]["val_accuracy"] > 0.9


def test_a_function_of_the_users_gives_the_data_and_another_the_model(tmp_path, monkeypatch):
    (tmp_path / "my_project.py").write_text(textwrap.dedent("""
        import keras
        import numpy as np
        import tensorflow as tf
        from tfdist.data import load_digits

        def digits():
            pixels, labels = load_digits()
            x, y = (pixels / 16.0).astype(np.float32)[..., None], labels
            return (tf.data.Dataset.from_tensor_slices((x[:1400], y[:1400])),
                    tf.data.Dataset.from_tensor_slices((x[1400:], y[1400:])))

        def batched():
            return tf.data.Dataset.from_tensor_slices((np.zeros((8, 8, 8, 1)), np.zeros(8))).batch(4)

        def small_cnn(input_shape, num_classes):
            return keras.Sequential([keras.Input(input_shape), keras.layers.Conv2D(16, 3, activation="relu"),
                                     keras.layers.Flatten(), keras.layers.Dense(num_classes, activation="softmax")],
                                    name="small_cnn")

        def wrong_width(input_shape, num_classes):
            return small_cnn(input_shape, num_classes + 1)

        def not_a_model(input_shape, num_classes):
            return "model"

        def other_signature(shape, classes):
            return small_cnn(shape, classes)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    result = _trained(_config("data.dataset=my_project:digits", "model.name=my_project:small_cnn"))
    assert result["steps_per_epoch"] == 1400 // 64 and result["final"]["val_accuracy"] > 0.85
    errors = [
        (["data.dataset=my_project:batched"], "data.dataset", "must return unbatched examples"),
        (["model.name=my_project:wrong_width"], "model.name", r"must output one score per class, shape \(batch, 10\)"),
        (["model.name=my_project:not_a_model"], "model.name", "must return a keras.Model; it returned a str"),
        (["model.name=my_project:other_signature"], "model.name",
         r"tfdist can call as FUNCTION\(input_shape=..., num_classes=...\); other_signature\(shape, classes\)"),
        (["model.name=json:dumps"], "model.name", r"FUNCTION\(input_shape=..., num_classes=...\); dumps\(obj, "),
        (["data.dataset=my_project:small_cnn"], "data.dataset", r"tfdist can call as FUNCTION\(\); small_cnn"),
        (["model.name=my_project:missing"], "model.name", "names no function of module my_project"),
        (["data.dataset=no_such_module:digits"], "data.dataset", "names a module that cannot be imported"),
    ]
    for overrides, key, message in errors:
        with pytest.raises(ConfigError, match=message) as raised:
            training.prepare(_config(*overrides))
        assert raised.value.key == key


def test_keras_applications_build_without_weights_for_the_datas_shape_and_classes():
    config = _config("model.name=keras.applications.MobileNetV2", "data.dataset=synthetic", "data.image_size=32",
                     "data.channels=3", "data.num_classes=5", "data.synthetic_examples=128",
                     "train.epochs=1", "train.steps_per_epoch=2", "train.global_batch_size=16")
    job = training.prepare(config)
    assert job.model.name.startswith("mobilenetv2") and job.model.output_shape == (None, 5)
    assert job.model.input_shape == (None, 32, 32, 3)
    job.model.fit(job.train_data, steps_per_epoch=2, epochs=1, verbose=0)
    with pytest.raises(ConfigError, match=r"`model.name` cannot be built for inputs of shape \(8, 8, 1\)"):
        training.prepare(_config("model.name=keras.applications.MobileNetV2"))
    with pytest.raises(ConfigError, match="must name a model of keras.applications"):
        training.prepare(_config("model.name=keras.applications.NoSuchNet"))


def test_a_saved_model_is_compiled_again_from_the_config_in_its_precision(tmp_path):
    x, y = _digits()
    saved = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    saved.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    path = tmp_path / "model.keras"
    saved.save(path)
    job = training.prepare(_config(f"model.name=file:{path}", "precision.policy=mixed_bfloat16"))
    assert [layer.dtype_policy.name for layer in job.model.layers] == ["mixed_bfloat16", "mixed_bfloat16", "float32"]
    # exact: loading copies the saved bytes (a float32 kernel stays float32 under mixed_bfloat16)
    np.testing.assert_array_equal(job.model.layers[1].kernel.numpy(), saved.layers[1].kernel.numpy())
    assert isinstance(job.model.optimizer, keras.optimizers.Adam)  # the config's, not the saved SGD
    result = _trained(_config(f"model.name=file:{path}"))
    assert result["final"]["val_accuracy"] > 0.85
    with pytest.raises(ConfigError, match="must name an existing .keras file"):
        training.prepare(_config(f"model.name=file:{tmp_path / 'missing.keras'}"))
    with pytest.raises(ConfigError, match=r"must output one score per class, shape \(batch, 3\)"):
        training.prepare(_config(f"model.name=file:{path}", "data.dataset=synthetic", "data.num_classes=3"))


@pytest.mark.parametrize("overrides, key, message", [
    (["data.dataset=npz:/no/such.npz"], "data.dataset", "must name an existing .npz file"),
    (["data.dataset=tfrecord:/no/such/*.tfrecord", f"data.features={FEATURES}"], "data.dataset",
     "must match at least one file"),
    (["data.dataset=images:/no/such/folder"], "data.dataset", "must name an existing folder"),
    (["data.validation=npz:/no/such.npz"], "data.validation", "must name an existing .npz file"),
])
def test_missing_files_are_one_line_naming_the_key(overrides, key, message):
    with pytest.raises(ConfigError, match=message) as raised:
        training.prepare(_config(*overrides))
    assert raised.value.key == key


def test_records_that_do_not_fit_the_feature_spec_and_arrays_of_the_wrong_form(tmp_path):
    x, y = _digits()
    pattern = _write_tfrecords(tmp_path / "records", 2, x, y)
    wrong = "[{name: image, dtype: float32, shape: [64, 2]}, {name: label, dtype: int64, shape: []}]"
    with pytest.raises(ConfigError, match=r"`data.features` does not match the records of .*digits-\*.tfrecord"):
        training.prepare(_config(f"data.dataset=tfrecord:{pattern}", f"data.features={wrong}"))
    np.savez(tmp_path / "no_y.npz", x=x)
    with pytest.raises(ConfigError, match="must hold arrays x and y .* it holds x"):
        training.prepare(_config(f"data.dataset=npz:{tmp_path / 'no_y.npz'}"))
    for name, write in [("pickled.npz", lambda path: path.write_bytes(pickle.dumps({"x": x}))),
                        ("one_array.npz", lambda path: np.save(open(path, "wb"), x))]:
        write(tmp_path / name)
        with pytest.raises(ConfigError, match="must name a .npz archive, as numpy.savez or savez_compressed writes"):
            training.prepare(_config(f"data.dataset=npz:{tmp_path / name}"))
    np.savez(tmp_path / "float_y.npz", x=x, y=y.astype(np.float32))
    with pytest.raises(ConfigError, match="must hold y as one integer class per row of x"):
        training.prepare(_config(f"data.dataset=npz:{tmp_path / 'float_y.npz'}"))


def test_tfrecords_shard_by_file_with_enough_files_and_by_record_otherwise(tmp_path):
    x, y = _digits()
    pattern = _write_tfrecords(tmp_path / "records", 3, x[:300], y[:300])
    source = load_source(_config(f"data.dataset=tfrecord:{pattern}", f"data.features={FEATURES}",
                                 "data.validation_fraction=0.01").data, seed=0)
    per_file = [{image.tobytes() for image in x[i:300:3]} for i in range(3)]
    dataset, how = shard(source.train, 2, 0)
    assert how == "file"
    seen = [{b[0].numpy().tobytes() for b in _compat.auto_shard(dataset, 2, i)} for i in range(2)]
    # Worker i reads only files i, i + 2, ...: whole files, none shared.
    assert seen[0] <= per_file[0] | per_file[2] and seen[1] <= per_file[1] and not seen[0] & seen[1]
    assert shard(source.train, 4, 0)[1] == "record"
    assert shard(source.train, 1, 0)[1] == "none"


def test_an_image_folder_is_split_by_path_before_reading(tmp_path):
    x, y = _digits()
    directory = _write_image_folder(tmp_path / "images", x, y, per_class=10)
    source = load_source(_config(f"data.dataset=images:{directory}").data, seed=0)
    shares = [shard(source.train, 2, i) for i in range(2)]
    assert [how for _, how in shares] == ["file", "file"]
    sizes = [sum(1 for _ in dataset) for dataset, _ in shares]
    assert sum(sizes) == source.train.count and abs(sizes[0] - sizes[1]) <= 1
    assert shard(source.train, 2, None)[1] == "record"  # parameter servers: the chief cannot know the worker


@pytest.mark.parametrize("overrides, key, message", [
    (["model.name=resnet"], "model.name", "must be a built-in model .* keras.applications.NAME, file:PATH.keras"),
    (["model.name=file:model.h5"], "model.name", "must name a saved Keras model file ending in .keras"),
    (["data.dataset=csv:/data"], "data.dataset", "must be a built-in dataset .* npz:PATH, tfrecord:GLOB"),
    (["data.dataset=tfrecord:/data/*.tfrecord"], "data.features", "must describe the records"),
    ([f"data.features={FEATURES}"], "data.features", "only applies to a tfrecord:GLOB source"),
    (["data.dataset=tfrecord:/d/*", f"data.features={FEATURES}", "data.label=y"], "data.label",
     "must name one of data.features"),
    (["data.validation=digits"], "data.validation", "must be npz:PATH, tfrecord:GLOB"),
    (["data.channels=2"], "data.channels", r"must be 1 \(grayscale\), 3 \(RGB\) or 4 \(RGBA\)"),
])
def test_source_names_are_checked_for_the_train_job_not_for_a_strategy(overrides, key, message):
    config = load_config(None, overrides)  # a user's own script builds its own model and data
    with pytest.raises(ConfigError, match=message) as raised:
        check_job(config)
    assert raised.value.key == key


def test_the_summary_names_the_input_sharding():
    from tfdist.reporting import format_summary

    result = {"strategy": "multi_worker_mirrored", "num_replicas": 2, "devices": ["/cpu:0"], "global_batch_size": 64,
              "precision": "float32", "samples_per_sec": 1.0, "step_time_ms": 1.0, "final": {},
              "input_sharding": "file (2 input pipelines, 3 files)"}
    assert "  input sharding  file (2 input pipelines, 3 files)" in format_summary(result)


def test_records_with_several_inputs_reach_a_model_of_ones_own_as_a_dict(tmp_path, monkeypatch):
    x, y = _digits()
    directory = tmp_path / "records"
    directory.mkdir()
    with tf.io.TFRecordWriter(str(directory / "two-inputs.tfrecord")) as writer:
        for image, label in zip(x, y):
            writer.write(tf.train.Example(features=tf.train.Features(feature={
                "pixels": tf.train.Feature(float_list=tf.train.FloatList(value=image.ravel())),
                "brightness": tf.train.Feature(float_list=tf.train.FloatList(value=[image.mean()])),
                "digit": tf.train.Feature(int64_list=tf.train.Int64List(value=[label])),
            })).SerializeToString())
    (tmp_path / "two_inputs.py").write_text(textwrap.dedent("""
        import keras

        def model(input_shape, num_classes):
            pixels = keras.Input(input_shape["pixels"], name="pixels")
            brightness = keras.Input(input_shape["brightness"], name="brightness")
            hidden = keras.layers.Dense(32, activation="relu")(keras.layers.Concatenate()([pixels, brightness]))
            return keras.Model({"pixels": pixels, "brightness": brightness},
                               keras.layers.Dense(num_classes, activation="softmax")(hidden))
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    features = ("[{name: pixels, shape: [64]}, {name: brightness, shape: [1]}, "
                "{name: digit, dtype: int64, shape: []}]")
    data = [f"data.dataset=tfrecord:{directory}/*.tfrecord", f"data.features={features}", "data.label=digit"]
    result = _trained(_config(*data, "model.name=two_inputs:model"))
    assert result["final"]["val_accuracy"] > 0.85
    with pytest.raises(ConfigError, match=r"takes one input, and the data has several \(pixels, brightness\)"):
        training.prepare(_config(*data))
