"""A launcher test program: behaves as argv[1] says, per process.

Modes that fail do so in process 1, while process 0 waits in a collective (jax modes) or
sleeps; every wait would hang the run without the launcher stopping it.
"""

import os
import signal
import sys
import time

mode = sys.argv[1]
process_id = int(os.environ["SUBSTRAX_PROCESS_ID"])


def _initialize():
    import substrax.distributed

    substrax.distributed.initialize()


def _wait_in_a_collective():
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("waits for process 1 forever")
    time.sleep(600)


if mode == "hello":
    print(f"hello from {process_id} of {os.environ['SUBSTRAX_NUM_PROCESSES']}", flush=True)
elif mode == "one-dies":
    if process_id == 1:
        sys.exit(3)
    time.sleep(600)
elif mode == "stubborn":  # ignores SIGTERM: only the launcher's SIGKILL ends it
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(f"pid {os.getpid()}", flush=True)
    time.sleep(600)
elif mode == "sleep":
    print(f"pid {os.getpid()}", flush=True)
    time.sleep(600)
elif mode == "killed":
    if process_id == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)
elif mode in ("raise", "exit0", "hang"):
    _initialize()
    if process_id == 1:
        print("process 1 about to fail", flush=True)
        if mode == "raise":
            raise ValueError("worker 1 failed on purpose")
        if mode == "exit0":
            sys.exit(0)
        os.kill(os.getpid(), signal.SIGSTOP)
    _wait_in_a_collective()
elif mode == "ends-apart":  # process 0 ends its script 2 s before process 1: a healthy run
    _initialize()
    if process_id == 1:
        time.sleep(2)
elif mode == "devices":
    _initialize()
    import jax

    from substrax.mesh import DeviceMeshManager

    mesh = DeviceMeshManager.create_multihost_mesh({"data": -1}, {"model": -1})
    info = DeviceMeshManager.get_mesh_info(mesh)
    rows = [{d.process_index for d in row} for row in mesh.devices]
    print(f"{jax.process_index()} {info['num_processes']} {info['num_local_devices']} {rows}")
elif mode == "weights":  # argv: a Llama checkpoint directory, then where process 0 exports it
    _initialize()
    import pathlib

    import jax
    from flax import nnx

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
    import llama

    import substrax_flax as sf
    from substrax.layout import Layout

    source = sys.argv[2]
    config = llama.LlamaConfig.from_json(source)
    plan = sf.plan_weights(
        lambda: llama.Llama(config, nnx.Rngs(0)), source=source, key_map=llama.key_map(config),
        layout=Layout.named("fsdp", {"data": jax.device_count()}),
    )  # fmt: skip
    model = plan.load()
    print(f"read {plan.checkpoint.bytes_read} of {plan.checkpoint.nbytes}", flush=True)
    llama.save_pretrained(model, sys.argv[3])  # every process gathers, process 0 writes
    print("exported", flush=True)
elif mode == "layouts-differ":  # process 1 was started with another layout (a typo on its host)
    _initialize()
    import jax
    from flax import nnx

    import substrax_flax as sf
    from substrax.layout import Layout

    name = "fsdp" if process_id == 0 else "dp"
    layout = Layout.named(name, {"data": jax.device_count()})
    model = sf.create_sharded_model(lambda: nnx.Linear(64, 64, rngs=nnx.Rngs(0)), layout=layout)
    print("created", flush=True)
elif mode == "devices-differ":  # process 1 was started with fewer simulated devices
    os.environ["SUBSTRAX_CPU_DEVICES"] = "1" if process_id == 1 else "2"
    _initialize()
    print("initialized", flush=True)
elif mode == "slow-compile":  # process 0 takes 8 s to trace its first step; both then step
    _initialize()
    import numpy as np
    import optax
    from flax import nnx

    import substrax_flax as sf
    from substrax.layout import Layout

    layout = Layout.named("fsdp", {"data": 2})
    model = sf.create_sharded_model(lambda: nnx.Linear(8, 8, rngs=nnx.Rngs(0)), layout=layout)
    optimizer = sf.create_sharded_optimizer(model, optax.sgd(0.1))
    slow = [process_id == 0]

    def loss(m, x):
        if slow.pop() if slow else False:
            time.sleep(8)  # as a large model's compile: the other process waits in step 1
        return (m(x) ** 2).mean()

    step = sf.make_train_step(loss)
    for _ in range(6):
        metrics = step(model, optimizer, np.ones((1, 8), np.float32))
    print(f"done, loss {float(metrics['loss']):.4f}", flush=True)
elif mode == "stall":  # process 1 stops stepping (alive, beating) at its 4th step
    _initialize()
    import numpy as np
    import optax
    from flax import nnx

    import substrax_flax as sf
    from substrax.layout import Layout

    layout = Layout.named("fsdp", {"data": 2})
    model = sf.create_sharded_model(lambda: nnx.Linear(8, 8, rngs=nnx.Rngs(0)), layout=layout)
    optimizer = sf.create_sharded_optimizer(model, optax.sgd(0.1))
    step = sf.make_train_step(lambda m, x: (m(x) ** 2).mean())
    for call in range(1, 100):
        if process_id == 1 and call == 4:
            time.sleep(600)  # stuck between steps: the other waits in step 4's collectives
        step(model, optimizer, np.ones((1, 8), np.float32))
