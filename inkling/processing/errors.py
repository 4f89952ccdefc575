"""The one error type of the processors: input a user sent that cannot become model input."""


class ProcessingError(ValueError):
    """Undecodable, oversized or inconsistent prompt, image or audio input."""
