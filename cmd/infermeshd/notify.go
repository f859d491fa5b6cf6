package main

// sdNotify sends state to systemd's notification socket ($NOTIFY_SOCKET)
// when the agent runs under a Type=notify unit; elsewhere it does nothing.
func sdNotify(state string) {
	_ = sdNotifyFDs(state)
}
