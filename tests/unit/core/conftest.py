import pytest

from lmcache.cache_engine import LMCacheEngineBuilder
from tests.helpers.paged_kv import build_engine


@pytest.fixture
def engine():
    e = build_engine()
    yield e
    e.close()


@pytest.fixture(autouse=True)
def _clean_builder():
    yield
    for name in list(LMCacheEngineBuilder.instance_ids()):
        LMCacheEngineBuilder.destroy(name)
