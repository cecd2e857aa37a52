"""The production extension's bindings hold no test controls: those live in its
testing submodule (`_sifar.testing`), which sifar_jax.testing and
sifar_jax._testing use; the retired polling knob is gone from both."""

from sifar_jax import _ext, _testing, testing

TEST_CONTROLS = ("set_skew", "set_drop", "set_epochs", "set_epoch_mask")


def test_test_controls_live_in_the_testing_submodule_only():
    for name in TEST_CONTROLS:
        assert not hasattr(_ext.lib, name), f"_sifar.{name} is a test control"
        assert callable(getattr(_ext.lib.testing, name)), name
    assert not hasattr(_ext.lib, "set_poll") and not hasattr(_ext.lib.testing, "set_poll")


def test_public_testing_api_is_kept():
    for name in ("inject_skew", "drop_rank", "timeout", "set_epochs", "epoch_bits"):
        assert callable(getattr(testing, name)), name
    assert callable(_testing.hammer_control)
