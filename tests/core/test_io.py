"""Writing a file whole: a stop while writing leaves the last whole file and nothing beside it."""

from __future__ import annotations

import numpy as np
import pytest

from pruneops.core.io import replaced_whole


def test_a_file_is_replaced_only_once_it_is_written_whole(tmp_path):
    path = tmp_path / "deep" / "scores.npz"
    with replaced_whole(path) as partial:
        assert partial.name == "scores.partial.npz"
        np.savez(partial, a=np.arange(3))  # np.savez keeps a name that ends in .npz as it is
    assert np.load(path)["a"].tolist() == [0, 1, 2] and sorted(p.name for p in path.parent.iterdir()) == ["scores.npz"]
    with pytest.raises(KeyboardInterrupt), replaced_whole(path) as partial:
        np.savez(partial, a=np.arange(5))
        raise KeyboardInterrupt  # stopped after writing, before the block ended
    assert np.load(path)["a"].tolist() == [0, 1, 2] and sorted(p.name for p in path.parent.iterdir()) == ["scores.npz"]
