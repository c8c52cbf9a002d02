from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from pruneops.config import ValidateConfig
from pruneops.core.errors import ConfigError, DataError, DataValidationError
from pruneops.core.io import Layout, read_json
from pruneops.data import load_prepared
from pruneops.task.classification.validate import validate_dataset


def _npz(path, n_train=120, n_test=40, shape=(6, 6), classes=3, seed=0):
    rng = np.random.default_rng(seed)
    data = {
        "x_train": rng.integers(0, 256, (n_train, *shape), dtype=np.uint8),
        "y_train": np.arange(n_train) % classes,
        "x_test": rng.integers(0, 256, (n_test, *shape), dtype=np.uint8),
        "y_test": np.arange(n_test) % classes,
    }
    np.savez(path, **data)
    return data


def test_digits_default_splits_scaled_and_stats_written(tmp_path):
    report = validate_dataset(ValidateConfig(), Layout(tmp_path))
    meta, train, val, test = load_prepared(report.data_dir)
    assert meta.input_shape == [1, 8, 8] and meta.num_classes == 10
    assert len(train) + len(val) + len(test) == 1797 - report.duplicates_dropped
    assert abs(len(test) / 1797 - 0.2) < 0.01
    assert train.x.min() >= 0.0 and train.x.max() <= 1.0 and train.x.dtype == np.float32
    assert report.expectations_failed == 0 and report.expectations_evaluated >= 9
    stats = read_json(report.data_dir / "reference_stats.json")
    assert len(stats["quantiles"]) == 64 and len(stats["histograms"][0]) == 20
    assert abs(sum(stats["histograms"][10]) - 1.0) < 1e-3
    assert len(stats["feature_groups"]) == 8
    assert "| samples |" in (report.data_dir / "validation.md").read_text()


def test_split_is_seeded(tmp_path):
    a = validate_dataset(ValidateConfig(seed=3), Layout(tmp_path / "a"))
    b = validate_dataset(ValidateConfig(seed=3), Layout(tmp_path / "b"))
    c = validate_dataset(ValidateConfig(seed=4), Layout(tmp_path / "c"))
    ya, yb, yc = (load_prepared(r.data_dir)[1].y for r in (a, b, c))
    assert np.array_equal(ya, yb) and not np.array_equal(ya, yc)


def test_npz_loader_adds_channel_axis_and_uses_uint8_range(tmp_path):
    _npz(tmp_path / "d.npz")
    report = validate_dataset(ValidateConfig(dataset="npz", path=str(tmp_path / "d.npz")), Layout(tmp_path))
    meta, train, _, test = load_prepared(report.data_dir)
    assert meta.input_shape == [1, 6, 6] and meta.value_range == [0.0, 255.0]
    assert len(test) == 40 and train.x.shape[1:] == (1, 6, 6)


def test_test_samples_leaking_from_train_fail_the_suite(tmp_path):
    data = _npz(tmp_path / "d.npz")
    data["x_test"][:5] = data["x_train"][:5]
    np.savez(tmp_path / "d.npz", **data)
    with pytest.raises(DataValidationError, match=r"expect_column_values_to_be_in_set\(in_train\)") as exc:
        validate_dataset(ValidateConfig(dataset="npz", path=str(tmp_path / "d.npz")), Layout(tmp_path))
    assert any("5 unexpected" in line for line in exc.value.details)
    assert not (tmp_path / "artifacts").exists()


def test_label_outside_declared_set_and_rare_class_fail(tmp_path):
    data = _npz(tmp_path / "d.npz")
    data["y_train"][:2] = 7
    np.savez(tmp_path / "d.npz", **data)
    cfg = ValidateConfig(dataset="npz", path=str(tmp_path / "d.npz"), classes=[0, 1, 2], min_samples_per_class=50)
    with pytest.raises(DataValidationError) as exc:
        validate_dataset(cfg, Layout(tmp_path))
    failed = "\n".join(exc.value.details)
    assert "label" in failed and "count" in failed


def test_values_outside_range_fail(tmp_path):
    _npz(tmp_path / "d.npz")
    cfg = ValidateConfig(dataset="npz", path=str(tmp_path / "d.npz"), value_range=[0, 100])
    with pytest.raises(DataValidationError, match="x_max"):
        validate_dataset(cfg, Layout(tmp_path))


def _table(n=90, seed=0):
    rng = np.random.default_rng(seed)
    return pd.DataFrame(
        {"a": rng.normal(size=n), "b": rng.normal(size=n), "c": rng.normal(size=n), "label": np.arange(n) % 3}
    )


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_table_loader_reads_csv_and_parquet(tmp_path, suffix):
    path = tmp_path / f"t{suffix}"
    frame = _table()
    frame.to_csv(path, index=False) if suffix == ".csv" else frame.to_parquet(path)
    report = validate_dataset(
        ValidateConfig(dataset="table", path=str(path), feature_columns=["a", "b", "c"]), Layout(tmp_path)
    )
    meta, train, _, _ = load_prepared(report.data_dir)
    assert meta.input_shape == [3] and meta.feature_names == ["a", "b", "c"]
    assert train.x.shape[1] == 3


def test_nan_in_table_fails_with_null_expectation(tmp_path):
    frame = _table()
    frame.loc[4, "b"] = np.nan
    frame.to_csv(tmp_path / "t.csv", index=False)
    with pytest.raises(DataValidationError) as exc:
        validate_dataset(ValidateConfig(dataset="table", path=str(tmp_path / "t.csv")), Layout(tmp_path))
    assert "n_nonfinite" in str(exc.value) or "not_be_null" in str(exc.value)


def test_wrong_column_count_fails_schema(tmp_path):
    _table().drop(columns=["c"]).to_csv(tmp_path / "t.csv", index=False)
    cfg = ValidateConfig(dataset="table", path=str(tmp_path / "t.csv"), feature_columns=["a", "b", "c"])
    with pytest.raises(DataValidationError, match="expect_table_columns_to_match_set"):
        validate_dataset(cfg, Layout(tmp_path))


def test_missing_and_corrupt_files_are_data_errors(tmp_path):
    with pytest.raises(DataError, match="data file not found"):
        validate_dataset(ValidateConfig(dataset="npz", path=str(tmp_path / "nope.npz")), Layout(tmp_path))
    (tmp_path / "bad.npz").write_bytes(b"not a zip at all")
    with pytest.raises(DataError, match="not a readable NPZ"):
        validate_dataset(ValidateConfig(dataset="npz", path=str(tmp_path / "bad.npz")), Layout(tmp_path))
    with pytest.raises(ConfigError, match="validate.path: required"):
        validate_dataset(ValidateConfig(dataset="npz"), Layout(tmp_path))


def test_idx_files_load_as_mnist_ships_them(tmp_path):
    """A folder of IDX files (gzipped or not) gives 1-channel images and int labels, exactly."""
    import gzip

    from pruneops.data.loaders import load_raw
    from tests.sweep.test_sweep import idx_bytes

    rng = np.random.default_rng(0)
    x_train, x_test = rng.integers(0, 256, (30, 5, 6), dtype=np.uint8), rng.integers(0, 256, (8, 5, 6), dtype=np.uint8)
    y_train, y_test = rng.integers(0, 10, 30, dtype=np.uint8), rng.integers(0, 10, 8, dtype=np.uint8)
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(idx_bytes(x_train)))
    (tmp_path / "train-labels-idx1-ubyte.gz").write_bytes(gzip.compress(idx_bytes(y_train)))
    (tmp_path / "t10k-images-idx3-ubyte").write_bytes(idx_bytes(x_test))
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(idx_bytes(y_test))
    raw = load_raw(ValidateConfig(dataset="idx", path=str(tmp_path)))
    assert raw.input_shape == (1, 5, 6) and raw.value_range == (0.0, 255.0)
    np.testing.assert_array_equal(raw.x_train[:, 0], x_train)
    np.testing.assert_array_equal(raw.y_test, y_test)
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(idx_bytes(y_test)[:-1])
    with pytest.raises(DataError, match="header says"):
        load_raw(ValidateConfig(dataset="idx", path=str(tmp_path)))
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(DataError, match=r"t10k-labels-idx1-ubyte\[\.gz\] not found"):
        load_raw(ValidateConfig(dataset="idx", path=str(tmp_path)))


FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")


@pytest.mark.skipif(
    not FASHION_MNIST.is_dir(), reason="Fashion-MNIST not installed (make vision-assets: Debian dataset-fashion-mnist)"
)
def test_real_fashion_mnist_loads_from_the_debian_package():
    from pruneops.data.loaders import load_raw

    raw = load_raw(ValidateConfig(dataset="idx", path=str(FASHION_MNIST)))
    assert raw.x_train.shape == (60_000, 1, 28, 28) and raw.x_test.shape == (10_000, 1, 28, 28)
    assert np.bincount(raw.y_train).tolist() == [6000] * 10 and np.bincount(raw.y_test).tolist() == [1000] * 10
    assert raw.x_train.min() == 0.0 and raw.x_train.max() == 255.0


def _image_folder(root: Path, images: dict[str, list[np.ndarray]], fmt: str = "PNG") -> None:
    from PIL import Image

    for name, arrays in images.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        for i, a in enumerate(arrays):
            Image.fromarray(a).save(root / name / f"{i}.{fmt.lower()}", format=fmt)


def test_image_folders_load_pixels_exactly_with_class_names_from_the_folders(tmp_path):
    """PNG is lossless, so the loaded pixels must equal the saved ones; labels follow sorted folder names."""
    from pruneops.data.loaders import load_raw

    rng = np.random.default_rng(0)
    train = {c: [rng.integers(0, 256, (6, 5, 3), dtype=np.uint8) for _ in range(4)] for c in ("dog", "cat")}
    test = {"dog": [rng.integers(0, 256, (6, 5, 3), dtype=np.uint8)]}
    _image_folder(tmp_path / "train", train)
    _image_folder(tmp_path / "test", test)
    (tmp_path / "train" / "cat" / ".DS_Store").write_bytes(b"\0")  # hidden files are not data
    raw = load_raw(ValidateConfig(dataset="image_folder", path=str(tmp_path)))
    assert raw.class_names == ["cat", "dog"] and raw.input_shape == (3, 6, 5)
    assert raw.y_train.tolist() == [0] * 4 + [1] * 4 and raw.y_test.tolist() == [1]
    np.testing.assert_array_equal(raw.x_train[0], train["cat"][0].transpose(2, 0, 1))
    np.testing.assert_array_equal(raw.x_test[0], test["dog"][0].transpose(2, 0, 1))
    assert raw.value_range == (0.0, 255.0) and raw.x_train.dtype == np.float32


def test_grayscale_image_folder_without_test_split_runs_validate(tmp_path):
    rng = np.random.default_rng(1)
    images = {c: [rng.integers(0, 256, (8, 8), dtype=np.uint8) for _ in range(20)] for c in ("a", "b", "c")}
    _image_folder(tmp_path / "data", images, "JPEG")
    report = validate_dataset(ValidateConfig(dataset="image_folder", path=str(tmp_path / "data")), Layout(tmp_path))
    meta, train, _, test = load_prepared(tmp_path / "artifacts/validate")
    assert meta.input_shape == [1, 8, 8] and meta.class_names == ["a", "b", "c"] and meta.num_classes == 3
    assert report.n_train + report.n_val + report.n_test == 60 and train.x.min() >= 0.0 and train.x.max() <= 1.0


def test_bad_image_folders_are_one_data_error_naming_the_file(tmp_path):
    from pruneops.data.loaders import load_raw

    def load(path):
        return load_raw(ValidateConfig(dataset="image_folder", path=str(path)))

    rng = np.random.default_rng(2)
    _image_folder(tmp_path / "sizes", {"a": [rng.integers(0, 256, (4, 4), dtype=np.uint8)] * 2})
    _image_folder(tmp_path / "sizes", {"b": [rng.integers(0, 256, (5, 4), dtype=np.uint8)]})
    with pytest.raises(DataError, match=r"b/0.png: 4x5 image, the first was 4x4"):
        load(tmp_path / "sizes")
    _image_folder(tmp_path / "corrupt", {"a": [rng.integers(0, 256, (4, 4), dtype=np.uint8)]})
    (tmp_path / "corrupt" / "a" / "1.png").write_bytes(b"\x89PNG not really")
    with pytest.raises(DataError, match=r"a/1.png: unreadable image"):
        load(tmp_path / "corrupt")
    from tests.conftest import png_bomb

    (tmp_path / "corrupt" / "a" / "1.png").write_bytes(png_bomb())
    with pytest.raises(DataError, match=r"a/1.png: larger than"):
        load(tmp_path / "corrupt")
    (tmp_path / "other" / "a").mkdir(parents=True)
    (tmp_path / "other" / "a" / "notes.txt").write_text("hi")
    with pytest.raises(DataError, match=r"not PNG/JPEG: notes.txt"):
        load(tmp_path / "other")
    (tmp_path / "flat").mkdir()
    with pytest.raises(DataError, match="no class folders"):
        load(tmp_path / "flat")
    _image_folder(tmp_path / "split" / "train", {"a": [rng.integers(0, 256, (4, 4), dtype=np.uint8)]})
    _image_folder(tmp_path / "split" / "test", {"zebra": [rng.integers(0, 256, (4, 4), dtype=np.uint8)]})
    with pytest.raises(DataError, match="classes not in the training folder: zebra"):
        load(tmp_path / "split")
    with pytest.raises(ConfigError, match="validate.path: required"):
        load_raw(ValidateConfig(dataset="image_folder"))


def test_class_imbalance_beyond_the_declared_ratio_fails(tmp_path):
    data = _npz(tmp_path / "d.npz", n_train=300)
    keep = (data["y_train"] != 2) | (np.cumsum(data["y_train"] == 2) <= 10)  # class 2 cut to 10 samples
    data["x_train"], data["y_train"] = data["x_train"][keep], data["y_train"][keep]
    np.savez(tmp_path / "d.npz", **data)
    biggest = int(np.bincount(data["y_train"]).max())
    ok = ValidateConfig(dataset="npz", path=str(tmp_path / "d.npz"), max_class_imbalance=biggest / 10)
    validate_dataset(ok, Layout(tmp_path / "ok"))  # exactly at the ratio: passes
    tight = ok.model_copy(update={"max_class_imbalance": biggest / 10 - 0.5})
    with pytest.raises(DataValidationError) as exc:
        validate_dataset(tight, Layout(tmp_path / "tight"))
    assert any("count" in line and "1 unexpected" in line for line in exc.value.details)


def test_a_label_column_with_one_class_fails_the_suite(tmp_path):
    _npz(tmp_path / "one.npz", classes=1)
    with pytest.raises(DataValidationError, match="expect_column_unique_value_count_to_be_between"):
        validate_dataset(ValidateConfig(dataset="npz", path=str(tmp_path / "one.npz")), Layout(tmp_path))


def test_a_file_that_is_not_a_table_does_not_have_its_first_line_echoed(tmp_path):
    secret = tmp_path / "credentials"
    secret.write_text("AKIA-very-secret-key-0123456789\nsecond line\n")
    with pytest.raises(DataError) as raised:
        validate_dataset(ValidateConfig(dataset="table", path=str(secret)), Layout(tmp_path))
    assert "secret" not in str(raised.value).replace(str(tmp_path), "")
    assert "single column" in str(raised.value)
