import pytest
from docstring_checks import check_google_docstring, public_callables

import substrax
import substrax.distributed
import substrax.hlo
import substrax.launch
import substrax.pipeline
import substrax.planner
import substrax.spmd
import substrax_flax


@pytest.mark.parametrize(
    ("name", "obj"),
    [
        *public_callables(substrax_flax),
        *public_callables(substrax),
        *public_callables(substrax.spmd),
        *public_callables(substrax.hlo),
        *public_callables(substrax.launch),
        *public_callables(substrax.pipeline),
        *public_callables(substrax.planner),
    ],
    ids=lambda v: str(v)[:60],
)
def test_every_public_name_has_a_google_docstring(name, obj):
    check_google_docstring(name, obj)


def test_the_issue_names_are_public():
    for name in (
        "plan_model",
        "ModelPlan",
        "create_sharded_model",
        "create_sharded_optimizer",
        "shard_model",
        "get_shardings",
        "sharding_report",
    ):
        assert name in substrax_flax.__all__
