"""The dense-feedback lab: probes whose findings say where a problem is, and the fault suite."""
