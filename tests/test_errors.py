"""The one "did you mean" hint that the spec loader, the config loader and the op library
all append to their errors (eulergen.errors.suggest)."""
from __future__ import annotations

from eulergen.errors import suggest


def test_a_near_miss_names_the_closest_option():
    assert suggest("learnig_rate", ["seed", "learning_rate", "min_lr"]) == \
        " (did you mean 'learning_rate'?)"


def test_the_hint_does_not_depend_on_the_order_of_the_options():
    # 'selu' is as near 'gelu' as 'relu'; spec keys come as sets, op names as dict keys,
    # and either order gives the same hint
    assert suggest("selu", ["gelu", "relu"]) == suggest("selu", ["relu", "gelu"]) \
        == " (did you mean 'relu'?)"


def test_no_near_miss_lists_the_options_only_when_asked():
    assert suggest("xyz", ["gpt2", "nanoeuler"]) == ""
    assert suggest("xyz", ["gpt2", "nanoeuler"], "preset") == " (valid presets: gpt2, nanoeuler)"
