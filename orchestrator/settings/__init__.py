"""What an option may be, said once for every way it is given (command line, run
files, the servers file, the Python API), and the prices a run is costed at."""
