sed -i 's/a - b/a + b/' packages/calc/calc.js
