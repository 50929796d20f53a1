"""Everything that touches a disk or a database. Imports protocol/, never runtime/."""
