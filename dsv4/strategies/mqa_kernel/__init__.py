"""mqa_kernel options: the sparse MQA call (queries over the window rows and the selected entries, with
sinks), one module per option; the index-list rules they share are dsv4/formats/index_lists.py."""
