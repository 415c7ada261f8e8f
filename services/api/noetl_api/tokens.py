"""AuthService: API tokens, created, listed and revoked by an admin token. A token is
shown once, in the CreateToken answer; the runtime keeps its SHA-256 only."""

from __future__ import annotations

from typing import Any

import grpc

from noetl_common import auth
from noetl_common.db import Pool
from noetl_common.errors import InvalidInput
from noetl_common.grpcutil import set_timestamp
from noetl_proto.v1 import auth_pb2, auth_pb2_grpc


def _info(row: dict[str, Any]) -> auth_pb2.TokenInfo:
    out = auth_pb2.TokenInfo(token_id=row["token_id"], name=row["name"], role=row["role"],
                             created_by=row.get("created_by") or "")
    set_timestamp(out.created_at, row.get("created_at"))
    set_timestamp(out.revoked_at, row.get("revoked_at"))
    return out


class AuthServicer(auth_pb2_grpc.AuthServiceServicer):
    def __init__(self, pool: Pool) -> None:
        self._pool = pool

    async def CreateToken(self, request: auth_pb2.CreateTokenRequest,
                          context: grpc.aio.ServicerContext) -> auth_pb2.CreateTokenResponse:
        role = auth.parse_role(request.role)
        if not request.name.strip():
            raise InvalidInput("a token needs a name")
        token = auth.new_token()
        who = auth.require_identity()
        identity = await auth.register_token(self._pool, role, request.name.strip(), token,
                                             created_by=who.name if who else "")
        rows = [r for r in await auth.list_tokens(self._pool, False) if r["token_id"] == identity.token_id]
        return auth_pb2.CreateTokenResponse(info=_info(rows[0]), token=token)

    async def ListTokens(self, request: auth_pb2.ListTokensRequest,
                         context: grpc.aio.ServicerContext) -> auth_pb2.ListTokensResponse:
        rows = await auth.list_tokens(self._pool, request.include_revoked)
        return auth_pb2.ListTokensResponse(tokens=[_info(r) for r in rows])

    async def RevokeToken(self, request: auth_pb2.RevokeTokenRequest,
                          context: grpc.aio.ServicerContext) -> auth_pb2.RevokeTokenResponse:
        if not request.name.strip():
            raise InvalidInput("name the token to revoke (its name or id)")
        return auth_pb2.RevokeTokenResponse(revoked=await auth.revoke_token(self._pool, request.name.strip()))
