import pytest

from lmcache.storage_backend.connectors import create_connector, parse_remote_url


def test_parses_hosts_path_credentials_and_options():
    u = parse_remote_url("redis-sentinel://user:p%40ss@h1:1,h2:2/mymaster/3?namespace=a&ttl=60")
    assert u.scheme == "redis-sentinel" and u.hosts == [("h1", 1), ("h2", 2)]
    assert u.path == ["mymaster", "3"] and u.username == "user" and u.password == "p@ss"
    assert u.namespace == "a" and u.options["ttl"] == "60"


@pytest.mark.parametrize("url, shown", [
    ("redis://user:p%40ss@h:1/2?ttl=5", "redis://user:***@h:1/2?ttl=5"),
    ("redis://:pw@h:1", "redis://:***@h:1"),
    ("redis-sentinel://user@h1:1,h2:2/svc", "redis-sentinel://user@h1:1,h2:2/svc"),
    ("lm://h:1?auth_token=tok&namespace=a", "lm://h:1?namespace=a"),
    ("lm://h:1?auth_token=tok", "lm://h:1"),
])
def test_the_url_a_message_shows_masks_the_password_and_drops_the_auth_token(url, shown):
    assert parse_remote_url(url).url == shown


@pytest.mark.parametrize("url", ["redis://u:S3cret@h:1?colour=red", "redis://u:S3cret@h:1?ttl=-3",
                                 "redis://u:S3cret@host", "lm://h:1?auth_token=S3cret&ttl=5",
                                 "redis:/u:S3cret@h:1"])
def test_a_bad_url_is_rejected_without_echoing_its_secrets(url):
    with pytest.raises(ValueError) as error:
        create_connector(url, 1.0)
    assert "S3cret" not in str(error.value)


@pytest.mark.parametrize("url", ["redis://host", "redis://host:x", "redis://:1", "lm://", "nohost",
                                 "redis://h:99999"])
def test_malformed_urls_are_rejected(url):
    with pytest.raises(ValueError):
        parse_remote_url(url)


@pytest.mark.parametrize("url, match", [
    ("redis://h:1?colour=red", "unknown option"),
    ("lm://h:1?ttl=5", "unknown option"),
    ("redis://h:1?ssl_ca_certs=/x", "unknown option"),  # TLS options need rediss://
    ("redis://h:1/zero", "must be a number"),
    ("redis://h:1?ttl=-3", "must be > 0"),
    ("redis-sentinel://h:1", "service name"),
    ("redis-cluster://h:1/0", "no path"),
    ("lm://h:1,h:2", "exactly one"),
    ("memcached://h:1", "unknown scheme"),
])
def test_bad_options_fail_at_start_up_with_a_clear_message(url, match):
    with pytest.raises(ValueError, match=match):
        create_connector(url, 1.0)


@pytest.mark.parametrize("url", ["lm://127.0.0.1:1", "redis://127.0.0.1:1/2?ttl=5&namespace=x",
                                 "valkeys://127.0.0.1:1?ssl_cert_reqs=none",
                                 "redis-sentinel://127.0.0.1:1,127.0.0.1:2/svc",
                                 "redis-cluster://127.0.0.1:1,127.0.0.1:2"])
def test_creating_a_connector_does_not_contact_the_store(url):
    create_connector(url, 0.5).close()  # nothing listens on these ports
