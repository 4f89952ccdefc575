"""How a refusal (a request we cannot serve as sent, not a fault of ours) is told apart on every path.

A composing model marks a refusal's message with REFUSAL and sends it with TritonError.INVALID_ARG. A BLS
caller gets a composing model's errors with their code reset (Triton server issue #7804: the ensemble's
`pipeline` saw INTERNAL for every one), and a gRPC stream's error responses carry no status at all, so
the mark is what the `pipeline` and the OpenAI front read: the client gets HTTP 400 / gRPC
INVALID_ARGUMENT for a refusal, 500 / INTERNAL for a fault.
"""

REFUSAL = "request refused: "


def is_refusal(message: str) -> bool:
    return message.startswith(REFUSAL)
