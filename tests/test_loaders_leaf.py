"""LEAF JSON loaders on tiny files in LEAF's own layout (train/ and test/ of .json files)."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from protofl.config import DataConfig
from protofl.data.leaf import (
    celeba_federation,
    femnist_federation,
    leaf_federation,
    read_leaf,
    write_leaf,
)
from protofl.data.synthetic import generate_synthetic
from protofl.errors import ProtoflError


def leaf_doc(users, xs, ys):
    """A LEAF document written by hand (independent of write_leaf)."""
    return {"users": users, "num_samples": [len(y) for y in ys],
            "user_data": {u: {"x": x, "y": y} for u, x, y in zip(users, xs, ys)}}


def test_write_then_read_synthetic(tmp_path):
    xs, ys = generate_synthetic(num_clients=4, seed=1)
    users = [f"f_{k:05d}" for k in range(4)]
    write_leaf(tmp_path / "train", users[:2], xs[:2], ys[:2], name="a.json")
    write_leaf(tmp_path / "train", users[2:], xs[2:], ys[2:], name="b.json")
    got = read_leaf(tmp_path / "train")
    assert list(got) == users
    for u, x, y in zip(users, xs, ys):
        np.testing.assert_allclose(got[u][0], x, rtol=1e-6)
        np.testing.assert_array_equal(got[u][1], y)
    data = leaf_federation(DataConfig(name="leaf", root=str(tmp_path)))
    assert data.num_clients == 4 and data.input_shape == (60,)
    assert data.train_sizes.sum() + len(data.x_local_test) == sum(len(y) for y in ys)
    for k in range(4):  # 90/10 split of each user, no sample lost
        n = len(ys[k])
        assert data.train_sizes[k] == n - min(max(round(0.1 * n), 1), n - 1)


def test_leaf_train_test_folders_used_per_user(tmp_path):
    """The FedProx layout: data/train/mytrain.json and data/test/mytest.json."""
    tr = leaf_doc(["u1", "u2"], [[[0.0, 1.0]] * 3, [[2.0, 2.0]] * 4], [[0, 1, 2], [1, 1, 3]])
    te = leaf_doc(["u1", "u2"], [[[5.0, 5.0]], [[6.0, 6.0]] * 2], [[2], [3, 3]])
    tr["user_data"]["u2"]["y"].append(0)
    tr["num_samples"][1] = 4
    (tmp_path / "data" / "train").mkdir(parents=True)
    (tmp_path / "data" / "test").mkdir()
    (tmp_path / "data" / "train" / "mytrain.json").write_text(json.dumps(tr))
    (tmp_path / "data" / "test" / "mytest.json").write_text(json.dumps(te))
    data = leaf_federation(DataConfig(name="leaf", root=str(tmp_path)))
    assert data.num_classes == 4
    assert data.train_sizes.tolist() == [3, 4]
    assert data.client_test(0)[1].tolist() == [2]
    assert data.client_test(1)[0][:, 0].tolist() == [6.0, 6.0]
    assert len(data.x_test) == 3


def test_leaf_bad_files(tmp_path):
    (tmp_path / "train").mkdir()
    bad = tmp_path / "train" / "broken.json"
    bad.write_text('{"users": ["a"], "user_data": {"a": {"x": [[1]], "y": [0, 1]}}}')
    with pytest.raises(ProtoflError, match="broken.json"):
        read_leaf(tmp_path / "train")
    bad.write_text("{not json")
    with pytest.raises(ProtoflError, match="broken.json"):
        leaf_federation(DataConfig(name="leaf", root=str(tmp_path)))
    with pytest.raises(ProtoflError, match="does not exist"):
        leaf_federation(DataConfig(name="leaf", root=str(tmp_path / "missing")))


def femnist_user(rng, labels):
    """x: 784 floats per sample, y: LEAF's 62-class labels."""
    return rng.random((len(labels), 784)).round(3).tolist(), [int(v) for v in labels]


def test_femnist_subsetting(tmp_path):
    rng = np.random.default_rng(0)
    # LEAF labels: 36..45 are 'a'..'j'; 0..35 digits and upper case are dropped
    specs = {
        "big": [36, 36, 37, 38, 39, 40, 41, 41, 41, 5, 12, 50],  # 6 of a-j, 9 samples
        "mid": [36, 37, 38, 39, 40, 40, 3],  # 5 of a-j, 6 samples
        "few": [36, 37, 38, 38, 38, 38, 38, 38, 38, 38],  # only 3 of a-j: never chosen
        "small": [42, 43, 44, 45, 36, 20, 21],  # 5 of a-j, 5 samples
    }
    users = list(specs)
    xs, ys = zip(*(femnist_user(rng, specs[u]) for u in users))
    (tmp_path / "train").mkdir()
    (tmp_path / "test").mkdir()
    # train in two files, as LEAF ships it; test holds one extra 'a' for "big"
    (tmp_path / "train" / "all_0.json").write_text(json.dumps(leaf_doc(users[:2], xs[:2],
                                                                       ys[:2])))
    (tmp_path / "train" / "all_1.json").write_text(json.dumps(leaf_doc(users[2:], xs[2:],
                                                                       ys[2:])))
    tx, ty = femnist_user(rng, [36, 61])
    (tmp_path / "test" / "t.json").write_text(json.dumps(leaf_doc(["big"], [tx], [ty])))
    data = femnist_federation(DataConfig(name="femnist", root=str(tmp_path), num_clients=2))
    assert data.num_classes == 10 and data.input_shape == (1, 28, 28)
    assert data.class_names[:3] == ["a", "b", "c"]
    # the 2 users with most samples in their top-5 a-j classes (train+test): big (9), mid (6)
    assert data.train_sizes.tolist() == [8, 6]
    big = data.client_train(0)[1].tolist()
    assert sorted(set(big)) == [0, 1, 2, 3, 5]  # 'e' ties b,c,d at one: lower kept
    assert set(data.client_train(1)[1].tolist()) == {0, 1, 2, 3, 4}
    assert data.client_test(0)[1].tolist() == [0]  # the test 'a' kept, 'z' (61) dropped
    assert len(data.client_test(1)[1]) == 0
    np.testing.assert_allclose(data.client_train(1)[0][0, 0].numpy(),
                               np.asarray(xs[1][0], np.float32).reshape(28, 28))
    with pytest.raises(ProtoflError, match="only 3 users"):
        femnist_federation(DataConfig(name="femnist", root=str(tmp_path), num_clients=4))


def test_celeba_images_and_labels(tmp_path):
    img_dir = tmp_path / "raw" / "img_align_celeba"
    img_dir.mkdir(parents=True)
    rng = np.random.default_rng(0)
    names = []
    for i in range(7):
        a = rng.integers(0, 256, (12, 10, 3)).astype(np.uint8)
        Image.fromarray(a).save(img_dir / f"{i:06d}.jpg", quality=95)
        names.append(f"{i:06d}.jpg")
    train = leaf_doc(["7", "9"], [names[:3], names[3:5]], [[1, 0, 1], [0, 0]])
    test = leaf_doc(["7", "9"], [names[5:6], names[6:7]], [[1], [0]])
    for split, doc in (("train", train), ("test", test)):
        (tmp_path / split).mkdir()
        (tmp_path / split / f"{split}.json").write_text(json.dumps(doc))
    data = celeba_federation(DataConfig(name="celeba", root=str(tmp_path), image_size=16))
    assert data.num_clients == 2 and data.num_classes == 2
    assert data.input_shape == (3, 16, 16)
    assert data.y_train.tolist() == [1, 0, 1, 0, 0] and data.y_test.tolist() == [1, 0]
    im = Image.open(img_dir / names[5]).convert("RGB")
    ref = np.asarray(im.resize((16, 16), Image.Resampling.BILINEAR), np.float32) / 255.0
    ref = ref.transpose(2, 0, 1)
    assert data.x_test.dtype == torch.uint8
    assert torch.equal(data.inputs(data.x_test[:1])[0], torch.from_numpy(ref))
    # a corrupt image names its file
    (img_dir / names[4]).write_bytes(b"not a jpeg")
    with pytest.raises(ProtoflError, match=names[4]):
        celeba_federation(DataConfig(name="celeba", root=str(tmp_path), image_size=16))
