"""OpenAI-style error objects: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from http import HTTPStatus

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    413: "RequestTooLargeError",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, HTTPStatus(status).phrase.replace(" ", "") + "Error"),
            "param": param,
            "code": status,
        }
    }


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


class ClientGone(Exception):
    """The client went away before its response was sent: logged as one INFO line, not an error."""

    def __init__(self, request_id: str, when: str = ""):
        super().__init__(f"request {request_id}: client disconnected{' ' + when if when else ''}")
        self.request_id = request_id
