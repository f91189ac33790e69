"""Long-running stress runs (fault matrix, fuzzing): not collected by pytest, run by command."""
