"""Scale runs on emulated GPU workers: live vs. simulator."""
