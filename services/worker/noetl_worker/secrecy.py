"""What a command's credentials may and may not reach: the keychain scope it renders with,
and the scrubbing of everything it reports.

    keychain_scope(spec, scope, secrets)
        The claim's spec carries the keychain entries the step's templates read
        (``spec["keychain"]``: alias -> entry, names only). Each entry's credential name is
        rendered with the command's scope, fetched (``CommandSecrets.get``: the api checks
        the step may read it) and exposed as ``keychain.<alias>`` = the credential's fields,
        so ``{{ keychain.api.token }}`` renders the token where the task needs it.

    scrub_outcome(outcome, redactor), scrub_call_result(result, redactor)
        Every task outcome (value, error message and details, stdout) and the command's
        CallResult (error, context, ``set`` updates) with the command's secret values
        masked (``noetl_common.redact``) and credential-shaped keys of error details
        masked: results, events, spans and logs get the masked form only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from noetl_client import values
from noetl_common.errors import NoetlError
from noetl_common.redact import Redactor, mask_secret_keys
from noetl_dsl.credrefs import reference_of
from noetl_dsl.templates import RenderContext, TemplateError, render
from noetl_proto.v1 import messages_pb2

from .tools.credentials import CommandSecrets, credential_failure
from .tools.outcome import CREDENTIAL_NOT_FOUND, INVALID_COMMAND, ErrorDetail, ToolOutcome


class KeychainError(NoetlError):
    """A keychain entry could not be resolved; ``outcome`` is the command's failure."""

    def __init__(self, outcome: ToolOutcome) -> None:
        self.outcome = outcome
        super().__init__(outcome.error.message if outcome.error is not None else "keychain")


async def keychain_scope(spec: Mapping[str, Any], scope: RenderContext,
                         secrets: CommandSecrets | None) -> dict[str, Any] | None:
    """``keychain.<alias>`` values for the entries in ``spec["keychain"]`` (None when there
    are none); KeychainError when one cannot be had."""
    entries = spec.get("keychain")
    if not isinstance(entries, Mapping) or not entries:
        return None
    resolved: dict[str, Any] = {}
    for alias, entry in entries.items():
        raw = reference_of(entry.get("credential")) or reference_of(entry.get("auth")) \
            if isinstance(entry, Mapping) else None
        if raw is None:
            raise KeychainError(ToolOutcome.failure(INVALID_COMMAND, f"keychain entry {alias!r} names no credential",
                                                    kind="ValueError"))
        try:
            name = render(raw, scope)
        except TemplateError as exc:
            raise KeychainError(ToolOutcome.failure(INVALID_COMMAND, f"keychain entry {alias!r}: {exc}",
                                                    kind="TemplateError")) from exc
        name = reference_of(name)
        what = f"credential of keychain entry {alias!r}"
        if name is None:
            raise KeychainError(ToolOutcome.failure(INVALID_COMMAND, f"{what} renders to no name", kind="ValueError"))
        if secrets is None:
            raise KeychainError(ToolOutcome.failure(CREDENTIAL_NOT_FOUND, f"{what} ({name!r}) not found (this worker"
                                                    " has no credential access)", kind="NotFound"))
        try:
            cred = await secrets.get(name.strip())
        except NoetlError as exc:
            raise KeychainError(credential_failure(exc, f"{what} ({name!r})")) from exc
        resolved[str(alias)] = dict(cred.data)
    return resolved


def scrub_outcome(outcome: ToolOutcome, redactor: Redactor | None) -> ToolOutcome:
    """The outcome as it may be reported (module docstring)."""
    error = outcome.error
    if error is not None and error.details:
        error = ErrorDetail(error.code, error.message, error.kind, error.retryable, mask_secret_keys(error.details),
                            error.exception_type)
    if not redactor:
        if error is outcome.error:
            return outcome
        return ToolOutcome(outcome.status, outcome.data, error, outcome.http, outcome.stdout)
    if error is not None:
        error = ErrorDetail(error.code, redactor.text(error.message), error.kind, error.retryable,
                            redactor.value(error.details), error.exception_type)
    return ToolOutcome(outcome.status, redactor.value(outcome.data), error, outcome.http,
                       redactor.text(outcome.stdout))


def scrub_call_result(result: messages_pb2.CallResult, redactor: Redactor | None) -> messages_pb2.CallResult:
    """The CallResult with the command's secrets masked in every text it carries (in place)."""
    if not redactor:
        return result
    parts: list[messages_pb2.CallResult | messages_pb2.IterationResult] = [result, *result.iterations]
    for part in parts:  # a batch's iterations too
        env = part.envelope
        env.error.message = redactor.text(env.error.message)
        env.error.traceback = redactor.text(env.error.traceback)
        if env.error.HasField("details"):
            env.error.details.CopyFrom(values.to_struct(redactor.value(values.from_struct(env.error.details)),
                                                        default=str, too_deep="json"))
        env.context_json = _scrub_json(env.context_json, redactor)
        part.set_json = _scrub_json(part.set_json, redactor)
    return result


def _scrub_json(text: str, redactor: Redactor) -> str:
    """JSON text with the secrets masked in its decoded strings (so a mask never splits an
    escape sequence), encoded again only when something changed."""
    if not text or redactor.text(text) == text:
        return text
    try:
        value = json.loads(text)
    except ValueError:
        return redactor.text(text)
    return json.dumps(redactor.value(value), separators=(",", ":"))


__all__ = ["KeychainError", "keychain_scope", "scrub_call_result", "scrub_outcome"]
