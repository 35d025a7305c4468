import numpy as np

from protofl.data.synthetic import generate_synthetic, synthetic_federation


def test_shapes_sizes_and_labels():
    xs, ys = generate_synthetic(1, 1, num_clients=30, seed=0)
    assert len(xs) == 30
    assert all(x.shape[1] == 60 and len(x) == len(y) >= 50 for x, y in zip(xs, ys))
    assert all(y.min() >= 0 and y.max() <= 9 for y in ys)
    sizes = np.array([len(y) for y in ys]) - 50
    # n_k - 50 = floor(lognormal(4, 2)): its log has mean ~4 and sd ~2
    logs = np.log(sizes[sizes > 0] + 0.5)
    assert 2.5 < logs.mean() < 5.5 and 1.0 < logs.std() < 3.0


def test_feature_covariance_is_j_to_minus_1_2():
    # alpha = beta = 0: v_k ~ N(0, 1) per client, x ~ N(v_k, diag(j^-1.2)) within a client
    xs, _ = generate_synthetic(0, 0, num_clients=40, seed=3)
    within = np.mean([x.var(0) for x in xs if len(x) > 200], axis=0)
    want = np.arange(1, 61) ** -1.2
    assert np.allclose(within, want, rtol=0.15)


def test_heterogeneity_grows_with_beta():
    def spread(beta):
        xs, _ = generate_synthetic(0, beta, num_clients=40, seed=1)
        return np.std([x.mean() for x in xs])
    assert spread(3.0) > 2 * spread(0.0)


def test_federation_split_90_10_and_seeded():
    a = synthetic_federation(num_clients=5, seed=7)
    b = synthetic_federation(num_clients=5, seed=7)
    assert a.num_clients == 5 and a.input_shape == (60,)
    assert (a.x_train == b.x_train).all()
    n_tr, n_te = a.train_sizes, np.diff(a.test_offsets)
    assert np.allclose(n_te / (n_tr + n_te), 0.1, atol=0.02)
    assert len(a.x_test) == len(a.x_local_test)


def test_federation_holds_exactly_the_generated_samples():
    xs, ys = generate_synthetic(1, 1, num_clients=6, seed=2)
    data = synthetic_federation(num_clients=6, seed=2)
    for k in range(6):
        x_tr, y_tr = data.client_train(k)
        x_te, y_te = data.client_test(k)
        assert np.array_equal(np.concatenate([x_te.numpy(), x_tr.numpy()]), xs[k])
        assert np.array_equal(np.concatenate([y_te.numpy(), y_tr.numpy()]), ys[k])
