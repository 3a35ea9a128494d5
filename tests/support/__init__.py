"""The tests' shared helpers and fakes, one module per concern; test modules import these, ``tests.history``,
``tests.faultlink`` and ``tests.static.import_graph``, never each other.

* ``waiting``: ``wait_for`` (poll with a deadline), ``pass_time``, ``Background``, ``LoopThread``;
* ``cluster``: ``Cluster`` (real coordinators and node daemons in the test's process, optionally behind
  ``tests.faultlink.FaultLink``s), reads for assertions (``queue``, ``leaked``, ``writes_since``, ...),
  ``EtcdEndpoint``;
* ``rpcs``: stubs, ``acquire_req``, ``expect_refused``, ``session_call``;
* ``patching``: fault injection by wrapping a component's own objects (``patch_method``, ``patch_commit``);
* ``processes``: coordinators, nodes and agents as child processes, ``LinkedReplica``, ``gpucoord_run``,
  ``ProcessGone``;
* ``fake_nvml``: ``FakeNvml``/``FakeDevice``;
* ``etcd_calls``: ``record_etcd_calls``, ``read_only``;
* ``pki``: ``make_pki``/``Pki``;
* ``etcd3``: a 3-member etcd for the fault tier, ``ClientFailovers``;
* ``load``: ``run_load``/``LoadReport``, ``flood``.
"""
from __future__ import annotations

import os

# The repository's root.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
