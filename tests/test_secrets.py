"""Credentials kept out of what is shown: URLs lose their user and password, secret-named
arguments their value."""

from __future__ import annotations

import pytest
from radixserve.secrets import is_secret_name, redact_args, redact_url


@pytest.mark.parametrize("url, shown", [
    ("redis://user:pw@host:6379/0", "redis://***@host:6379/0"),
    ("redis://:pw@host/0", "redis://***@host/0"),
    ("rediss://user:p@ss@host/0", "rediss://***@host/0"),  # an unescaped @ in the password
    ("redis://host:6379/0", "redis://host:6379/0"),
    ("http://[::1]:8000/v1", "http://[::1]:8000/v1"),
    ("/a/path/with@sign", "/a/path/with@sign"),
    ('{"url": "redis://u:secret@h:1/0", "mail": "a@b"}', '{"url": "redis://***@h:1/0", "mail": "a@b"}'),
])
def test_redact_url(url, shown):
    assert redact_url(url) == shown


def test_redact_args_hides_secret_names_and_url_credentials():
    args = {"api_key": "k", "admin_api_key": None, "hf_token": "t", "hicache_storage_secret": "s",
            "redis_password": "p", "hicache_storage_url": "redis://u:pw@h/0", "token_usage": 0.5,
            "max_new_tokens": 16, "urls": ["http://a:b@c/"], "nested": {"password": "x", "url": "s3://k:v@b/"}}
    shown = redact_args(args)
    assert shown == {"api_key": "***", "admin_api_key": None, "hf_token": "***", "hicache_storage_secret": "***",
                     "redis_password": "***", "hicache_storage_url": "redis://***@h/0", "token_usage": 0.5,
                     "max_new_tokens": 16, "urls": ["http://***@c/"],
                     "nested": {"password": "***", "url": "s3://***@b/"}}
    assert args["api_key"] == "k"  # a copy
    assert is_secret_name("--admin-api-key") and not is_secret_name("bos_token_id")
