sed -i 's/a - b/a + b/' src/lib.rs
