"""cache_layout options: how a cached KV row is stored, one module per layout class (plain.py holds bf16 and
float32); each is described by its RowFormat (dsv4/formats/row_format.py), the record formats they share
are dsv4/formats/."""
