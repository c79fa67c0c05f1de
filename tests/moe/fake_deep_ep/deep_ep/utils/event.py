"""``deep_ep.EventOverlap`` / ``EventHandle`` stand-ins: everything here is synchronous, so waiting is a no-op."""


class EventHandle:
    def current_stream_wait(self) -> None:
        return None


class EventOverlap:
    def __init__(self, event: EventHandle | None = None) -> None:
        self.event = event

    def current_stream_wait(self) -> None:
        return None
