"""Seed path alias of `lmcache.memory_management`."""

from lmcache.memory_management import *  # noqa: F403
