"""Hardware probes and measured trials (issue 3). The local probe lives in advisor.hardware.probe."""
