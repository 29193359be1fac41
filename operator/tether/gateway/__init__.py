"""HTTP gateway for external workers: claim, heartbeat, checkpoint, complete, fail, cancel."""
