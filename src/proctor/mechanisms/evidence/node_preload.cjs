'use strict';
// proctor's evidence preload for node's test runners, loaded by the host through NODE_OPTIONS=--require.
//
// The host copies this file, under a name of its own making, into a directory validation sees read-only,
// and sets OUT in the copy: a directory the run may write. In a process that is jest's, vitest's or mocha's
// own command line (told by the real path of the script node runs, never by the tree's files), it notes the
// start (`start-<kind>-<pid>`) and adds the runner's own JSON reporter, writing to OUT, to the arguments the
// runner is about to parse. So `npm test`, a workspace's `pnpm -r test`, a Makefile or a script reach the
// reporter as PYTEST_ADDOPTS reaches pytest. It decides nothing: the host reads the files
// (proctor.mechanisms.evidence.readers) and judges. Core modules only: nothing the tree can shadow.
const OUT = null;  // set by the host in its copy of this file

(function () {
  if (!OUT) return;
  const fs = require('fs');
  const path = require('path');
  let script;
  try { script = fs.realpathSync(process.argv[1] || ''); } catch (e) { return; }
  const parts = script.split(path.sep);
  const name = parts[parts.length - 1] || '', dir = parts[parts.length - 2] || '', pkg = parts[parts.length - 3] || '';
  let kind = null;
  if (dir === 'vitest' && /^vitest\.(mjs|cjs|js)$/.test(name)) kind = 'vitest';
  else if (dir === 'bin' && (pkg === 'jest' || pkg === 'jest-cli') && /^jest(\.js)?$/.test(name)) kind = 'jest';
  else if (dir === 'bin' && pkg === 'mocha' && /^_?mocha(\.js)?$/.test(name)) kind = 'mocha';
  if (!kind) return;
  const args = process.argv.slice(2);
  // A runner that starts itself again (mocha's bin/mocha.js -> _mocha) passes these on: added once.
  if (args.some(a => String(a).indexOf(OUT) >= 0)) return;
  const quiet = ['--version', '-v', '--help', '-h', '--listTests', '--showConfig', '--init'];
  if (args.some(a => quiet.indexOf(a) >= 0)) return;
  if (kind === 'vitest' && ['list', 'bench', 'init'].indexOf(args.find(a => !String(a).startsWith('-'))) >= 0) return;
  const file = path.join(OUT, kind + '-' + process.pid + '.json');
  try { fs.writeFileSync(path.join(OUT, 'start-' + kind + '-' + process.pid), ''); } catch (e) { return; }
  if (kind === 'vitest') process.argv.push('--reporter=default', '--reporter=json', '--outputFile.json=' + file);
  else if (kind === 'jest') process.argv.push('--json', '--outputFile=' + file);
  else process.argv.push('--reporter=json', '--reporter-option=output=' + file);
})();
