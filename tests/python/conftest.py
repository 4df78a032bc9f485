import pytest

from kvd_daemon import KvdDaemon


@pytest.fixture(scope="module")
def daemon():
    d = KvdDaemon()
    yield d
    d.stop()
