import pytest
from docstring_checks import check_google_docstring, public_callables

import substrax
import substrax.distributed
import substrax.hlo
import substrax.launch
import substrax.layout
import substrax.pipeline
import substrax.planner
import substrax.spmd
import substrax.target
import substrax_flax
import substrax_flax.compile
import substrax_flax.planner


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
        *public_callables(substrax.layout),
        *public_callables(substrax.target),
        *public_callables(substrax_flax.planner),
        *public_callables(substrax_flax.compile),
    ],
    ids=lambda v: v if isinstance(v, str) else getattr(v, "__qualname__", type(v).__name__),
)
def test_every_public_name_has_a_google_docstring(name, obj):
    check_google_docstring(name, obj)


def test_the_four_steps_take_the_models_plan_and_no_arguments_again():
    """create -> optimizer -> step -> report with nothing passed twice, on a named layout."""
    import optax
    from flax import nnx
    from flax_test_models import Transformer, token_loss, tokens

    model = substrax_flax.create_sharded_model(lambda: Transformer(nnx.Rngs(0)), layout=LAYOUT)
    optimizer = substrax_flax.create_sharded_optimizer(model, optax.sgd(0.1))
    before = model.head[...].sharding
    metrics = substrax_flax.make_train_step(token_loss)(model, optimizer, tokens())
    report = substrax_flax.sharding_report(model)
    assert float(metrics["loss"]) > 0 and model.head[...].sharding == before
    assert report.row("head").spec == before.spec and report.row("head").rule != "-"
    assert before.mesh.shape == LAYOUT.shape and int(optimizer.step[...]) == 1


LAYOUT = substrax.layout.Layout.named("fsdp+tp", {"data": 2, "model": 4})
