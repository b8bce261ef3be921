"""radixgate HTTP gateway: the only room with HTTP and process I/O."""
