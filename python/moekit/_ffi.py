"""The binding module (src/moekit/bindings/ffi.cc), loaded through apache-tvm-ffi.

`libmoekit_ffi.so` sits beside this file in an installed package; $MOEKIT_FFI_LIBRARY names
another one (a build tree's). The module links neither libpython nor torch, so the same file
serves every Python and torch version.
"""

import os

import tvm_ffi

_path = os.environ.get("MOEKIT_FFI_LIBRARY") or os.path.join(os.path.dirname(__file__), "libmoekit_ffi.so")
if not os.path.exists(_path):
    raise ImportError(f"moekit: the binding library is missing ({_path}); install the package with `pip install .`")

_mod = tvm_ffi.load_module(_path)

version = _mod["version"]
built_with_cuda = _mod["built_with_cuda"]
backends = _mod["backends"]
device_description = _mod["device_description"]
explain = _mod["explain"]
quantize_activations_fp8 = _mod["quantize_activations_fp8"]
plan = _mod["plan"]
checkpoint_tensors = _mod["checkpoint_tensors"]
pack = _mod["pack"]
synthesize = _mod["synthesize"]
layer_create = _mod["layer_create"]
workspace_bytes = _mod["workspace_bytes"]
batched_workspace_bytes = _mod["batched_workspace_bytes"]
forward_logits = _mod["forward_logits"]
forward_logits_tokens = _mod["forward_logits_tokens"]
forward_topk = _mod["forward_topk"]
forward_batched = _mod["forward_batched"]
check = _mod["check"]
layer_info = _mod["layer_info"]
env_stream = _mod["env_stream"]
# Expert parallelism (include/moekit/ep.hpp): moekit.torch's ep_group / pack_ep.
ep_unique_id = _mod["ep_unique_id"]
ep_group_create = _mod["ep_group_create"]
ep_group_info = _mod["ep_group_info"]
ep_layer_create = _mod["ep_layer_create"]
ep_layer_info = _mod["ep_layer_info"]
ep_forward_logits = _mod["ep_forward_logits"]
ep_forward_topk = _mod["ep_forward_topk"]
ep_forward_batched = _mod["ep_forward_batched"]
ep_batched_workspace_bytes = _mod["ep_batched_workspace_bytes"]
ep_batch = _mod["ep_batch"]
ep_dispatch = _mod["ep_dispatch"]
ep_combine = _mod["ep_combine"]
ep_check = _mod["ep_check"]
ep_reset = _mod["ep_reset"]
