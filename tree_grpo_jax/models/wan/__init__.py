"""The Wan2.1 video family."""
