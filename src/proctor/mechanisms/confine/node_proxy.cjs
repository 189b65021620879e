'use strict';
// Loaded with NODE_OPTIONS=--require (an adapter's `node_proxy = true`; proctor.services.job.prepare): makes
// a node CLI that ignores HTTPS_PROXY & co. use that HTTP CONNECT proxy anyway. Covers node's built-in
// fetch (undici: its global dispatcher becomes an Agent whose connect opens a CONNECT tunnel) and the
// http/https modules' global agents (the same tunnel). Plain http:// targets
// are tunnelled with CONNECT too. NO_PROXY (comma list, "*", host or .suffix, optional :port) is honoured.
// No dependencies; node >= 18.
const net = require('net');
const tls = require('tls');
const http = require('http');
const https = require('https');

const env = (n) => process.env[n] || process.env[n.toLowerCase()] || '';
const raw = env('HTTPS_PROXY') || env('HTTP_PROXY') || env('ALL_PROXY');
let proxy = null;
try { proxy = raw ? new URL(raw.includes('://') ? raw : `http://${raw}`) : null; } catch { proxy = null; }

if (proxy && proxy.protocol === 'http:') {
  const noProxy = env('NO_PROXY').split(/[\s,]+/).filter(Boolean);
  const bare = (h) => String(h).replace(/^\[|\]$/g, '').toLowerCase();
  const bypass = (host, port) => noProxy.some((e) => {
    if (e === '*') return true;
    const m = /^(.*?)(?::(\d+))?$/.exec(e);
    if (m[2] && Number(m[2]) !== port) return false;
    const rule = bare(m[1]).replace(/^\*?\./, '.');
    const h = bare(host);
    return h === rule.replace(/^\./, '') || (rule.startsWith('.') && h.endsWith(rule));
  });
  const auth = proxy.username
    ? `Proxy-Authorization: Basic ${Buffer.from(`${decodeURIComponent(proxy.username)}:${decodeURIComponent(proxy.password)}`).toString('base64')}\r\n`
    : '';

  // A TCP socket to host:port through the proxy, or straight to it when NO_PROXY says so.
  const tunnel = (host, port, cb) => {
    const h = bare(host);
    if (bypass(h, port)) {
      const s = net.connect(port, h);
      s.once('error', cb).once('connect', () => { s.removeListener('error', cb); cb(null, s); });
      return;
    }
    const authority = net.isIPv6(h) ? `[${h}]:${port}` : `${h}:${port}`;
    const s = net.connect(Number(proxy.port) || 80, bare(proxy.hostname));
    let head = Buffer.alloc(0);
    let settled = false;
    const fail = (err) => { if (!settled) { settled = true; s.destroy(); cb(err); } };
    s.setTimeout(30000, () => fail(new Error(`proxy ${proxy.host}: CONNECT ${authority} timed out`)));
    s.once('error', fail);
    s.once('connect', () => s.write(`CONNECT ${authority} HTTP/1.1\r\nHost: ${authority}\r\n${auth}\r\n`));
    s.on('data', function onData(chunk) {
      head = Buffer.concat([head, chunk]);
      const end = head.indexOf('\r\n\r\n');
      if (end < 0) { if (head.length > 16384) fail(new Error('proxy: response head too large')); return; }
      s.removeListener('data', onData);
      s.pause();
      const status = head.toString('latin1', 0, end).split('\r\n')[0];
      if (!/^HTTP\/1\.[01] 2\d\d/.test(status)) return fail(new Error(`proxy ${proxy.host} refused CONNECT ${authority}: ${status}`));
      if (head.length > end + 4) s.unshift(head.subarray(end + 4));
      settled = true;
      s.setTimeout(0);
      s.removeListener('error', fail);
      cb(null, s);
    });
  };

  // ... and TLS over it for https.
  const open = (secure, host, port, servername, cb, tlsOpts = {}) => tunnel(host, port, (err, s) => {
    if (err || !secure) return cb(err, s);
    // host: what the certificate is checked against (an IP literal too); servername: SNI, never an IP.
    const h = bare(host);
    const name = servername || (net.isIP(h) ? undefined : h);
    const t = tls.connect({ ALPNProtocols: ['http/1.1'], ...tlsOpts, socket: s, host: h, servername: name });
    t.once('error', cb).once('secureConnect', () => { t.removeListener('error', cb); cb(null, t); });
  });

  // node's fetch: undici's global dispatcher, an Agent from node's own undici whose connect is ours. Touching
  // `Headers` loads that undici, which installs its default Agent; its class is what we need.
  try {
    const key = Symbol.for('undici.globalDispatcher.1');
    void globalThis.Headers;
    const Agent = globalThis[key] && globalThis[key].constructor;
    if (Agent) {
      globalThis[key] = new Agent({
        connect: (o, cb) => open(o.protocol === 'https:', o.hostname, Number(o.port) || (o.protocol === 'https:' ? 443 : 80),
          o.servername, cb),
      });
    }
  } catch (e) {
    process.emitWarning(`proxy preload: fetch left unproxied: ${e && e.message}`);
  }

  // http / https modules (node-fetch, axios without its own proxy, got, ...): their global agents.
  const patch = (mod, secure) => {
    const agent = new mod.Agent({ keepAlive: true });
    agent.createConnection = (o, oncreate) => {
      const { ca, cert, key, pfx, passphrase, rejectUnauthorized, checkServerIdentity, minVersion, ciphers } = o;
      open(secure, o.host || o.hostname || 'localhost', Number(o.port) || (secure ? 443 : 80), o.servername, oncreate,
        Object.fromEntries(Object.entries({ ca, cert, key, pfx, passphrase, rejectUnauthorized, checkServerIdentity,
          minVersion, ciphers }).filter(([, v]) => v !== undefined)));
    };
    mod.globalAgent = agent;
  };
  patch(http, false);
  patch(https, true);
}
