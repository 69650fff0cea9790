"""head_padding options: the head count the q/out buffers are allocated at."""
