"""The roles a token can have (``auth`` decides what each may call; the CLI lists them
without importing ``auth``'s server-side machinery)."""

from enum import StrEnum


class Role(StrEnum):
    ADMIN = "admin"
    SUBMIT = "submit"
    READ = "read"
    WORKER = "worker"
    SERVICE = "service"
