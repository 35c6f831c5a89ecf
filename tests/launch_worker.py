"""A launcher test program: behaves as argv[1] says, per process."""

import os
import sys
import time

mode = sys.argv[1]
process_id = int(os.environ["SUBSTRAX_PROCESS_ID"])
if mode == "hello":
    print(f"hello from {process_id} of {os.environ['SUBSTRAX_NUM_PROCESSES']}", flush=True)
elif mode == "one-dies":
    if process_id == 1:
        sys.exit(3)
    time.sleep(600)  # would hang without the launcher stopping it
elif mode == "devices":
    import substrax.distributed

    substrax.distributed.initialize()
    import jax

    from substrax.mesh import DeviceMeshManager

    mesh = DeviceMeshManager.create_multihost_mesh({"data": -1}, {"model": -1})
    info = DeviceMeshManager.get_mesh_info(mesh)
    rows = [{d.process_index for d in row} for row in mesh.devices]
    print(f"{jax.process_index()} {info['num_processes']} {info['num_local_devices']} {rows}")
