"""Domain errors of scheduler_svc; the gRPC layer maps them to status codes. No gRPC imports here."""


class InvalidArgument(Exception):
    """A request parameter is out of range; mapped to INVALID_ARGUMENT.

    `str(err)` names the field first, e.g. "top_p: must be in (0, 1], got 1.5".
    """

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = f"{field}: {message}"
        super().__init__(self.message)


class ExecutorDisagreement(Exception):
    """The executor's answer does not fit the plan it was sent (e.g. it sampled another set of
    sequences): its state can no longer be trusted. The engine treats it as executor loss."""
